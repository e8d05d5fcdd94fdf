"""Hugging Face transformers (BERT, GPT-2, the T5 encoder; small configs, no
weights) through multi_stream and the compile backend, under the stream
sanitizer.

Symbolic tracing cannot follow these models (they branch on tensors and
iterate over them), so multi_stream captures them with torch.export when
example inputs are given (torch_stage/streams/fx/multi_stream_pass.py); the result
keeps forward's call signature and output type."""

import copy
import warnings

import pytest
import torch

import torch_stage

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.own_sanitizer


def bert():
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertModel(config)


def gpt2():
    config = transformers.GPT2Config(
        vocab_size=100,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        # A cache object is not a tensor output torch.export can return.
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2Model(config)


def t5_encoder():
    config = transformers.T5Config(
        vocab_size=100, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, dropout_rate=0.0
    )
    return transformers.T5EncoderModel(config)


MODELS = {"bert": bert, "gpt2": gpt2, "t5_encoder": t5_encoder}


def ids(batch, length, seed=0):
    return torch.randint(0, 100, (batch, length), generator=torch.Generator().manual_seed(seed))


def build(name):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MODELS[name]().eval()


@pytest.mark.parametrize("name", MODELS)
def test_multi_stream_captures_by_export_and_equals_eager(name):
    model = build(name)
    x = ids(2, 16)
    rewritten = torch_stage.multi_stream(model, num_streams=4, example_inputs=(x,))
    plan = rewritten.stream_plan
    with torch.no_grad(), torch_stage.sanitize_streams():
        out = rewritten(x)
        # Every dimension is dynamic: other batch and sequence sizes run too.
        other = rewritten(ids(3, 9, seed=1))
    with torch.no_grad():
        ref, ref_other = model(x), model(ids(3, 9, seed=1))
    assert type(out) is type(ref)
    assert torch.equal(out.last_hidden_state, ref.last_hidden_state)
    assert torch.equal(other.last_hidden_state, ref_other.last_hidden_state)
    # Attention's query, key and value projections spread over the pool.
    assert len(plan.streams_used) >= 3, str(plan)
    # Shape reads and the input guards export adds are host work: no stream.
    assert not [n for n in plan.assignment if n.startswith("sym_size") or n == "_guards_fn"], str(
        plan
    )


def padding_mask(batch, length, seed=0):
    """Rows padded after a random length, as a tokenizer's batch is."""
    lengths = torch.randint(1, length + 1, (batch,), generator=torch.Generator().manual_seed(seed))
    return (torch.arange(length) < lengths[:, None]).long()


@pytest.mark.parametrize("name", MODELS)
def test_an_attention_mask_given_by_keyword_is_planned_and_equals_eager(
    name, planned_with_vm_costs
):
    # GPT-2 takes attention_mask after past_key_values, so it can only be
    # given by keyword; every model is called that way by its users.
    model = build(name)
    x, mask = ids(4, 16), padding_mask(4, 16)
    assert (mask == 0).any()
    rewritten = torch_stage.multi_stream(
        model, num_streams=4, example_inputs=(x,), example_kwargs={"attention_mask": mask}
    )
    assert len(rewritten.stream_plan.streams_used) >= 3, str(rewritten.stream_plan)
    other, other_mask = ids(3, 9, seed=1), padding_mask(3, 9, seed=1)
    with torch.no_grad(), torch_stage.sanitize_streams():
        out = rewritten(x, attention_mask=mask)
        out_other = rewritten(other, attention_mask=other_mask)
    with torch.no_grad():
        ref = model(x, attention_mask=mask)
        ref_other = model(other, attention_mask=other_mask)
        unmasked = model(x)
    assert torch.equal(out.last_hidden_state, ref.last_hidden_state)
    assert torch.equal(out_other.last_hidden_state, ref_other.last_hidden_state)
    # The mask was planned, not dropped: it changes the result.
    assert not torch.equal(out.last_hidden_state, unmasked.last_hidden_state)
    # And the plan holds what the model does with one: a call without it is
    # refused, saying so.
    with pytest.raises(AssertionError, match="attention_mask has been specialized to have a"):
        rewritten(x)


def test_a_mask_that_was_none_in_the_examples_is_refused_not_ignored():
    # torch.export makes a None input a constant of its input spec and
    # ignores a tensor given there later: the plan would run unmasked.
    model = build("bert")
    x, mask = ids(2, 16), padding_mask(2, 16)
    rewritten = torch_stage.multi_stream(
        model, num_streams=4, example_inputs=(x,), example_kwargs={"attention_mask": None}
    )
    with torch.no_grad():
        assert torch.equal(rewritten(x).last_hidden_state, model(x).last_hidden_state)
        with pytest.raises(AssertionError, match="attention_mask has been specialized"):
            rewritten(x, attention_mask=mask)
        # The same for an argument left out of the examples (its default None).
        with pytest.raises(AssertionError, match="token_type_ids has been specialized"):
            rewritten(x, token_type_ids=torch.zeros_like(x))


def test_only_keyword_examples_are_enough():
    model = build("bert")
    x, mask = ids(2, 16), padding_mask(2, 16)
    rewritten = torch_stage.multi_stream(
        model, num_streams=4, example_kwargs={"input_ids": x, "attention_mask": mask}
    )
    with torch.no_grad(), torch_stage.sanitize_streams():
        out = rewritten(input_ids=x, attention_mask=mask)
    with torch.no_grad():
        ref = model(input_ids=x, attention_mask=mask)
    assert torch.equal(out.last_hidden_state, ref.last_hidden_state)


def test_training_through_the_exported_plan_is_race_free_and_bit_equal():
    model = build("bert").train()
    x = ids(2, 16)
    rewritten = torch_stage.multi_stream(model, num_streams=4, example_inputs=(x,))
    with torch_stage.sanitize_streams():
        rewritten(x).last_hidden_state.square().sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model(x).last_hidden_state.square().sum().backward()
    assert grads and grads.keys() == {k for k, p in model.named_parameters() if p.grad is not None}
    assert all(torch.equal(grads[k], p.grad) for k, p in model.named_parameters() if k in grads)


@pytest.mark.parametrize("executor", ["inductor", "eager"])
@pytest.mark.parametrize("name", MODELS)
def test_compile_backend_equals_the_compiler_it_runs_on(name, executor):
    # The eager executor runs Dynamo's graph: as Dynamo's eager backend. The
    # inductor executor on the CPU compiles Dynamo's graph as it is: as
    # inductor alone.
    model = build(name)
    x = ids(2, 16)
    with torch.no_grad():
        torch._dynamo.reset()
        expected = torch.compile(model, backend="eager" if executor == "eager" else "inductor")(x)
        torch._dynamo.reset()
        options = {"num_streams": 4, "executor": executor}
        with torch_stage.sanitize_streams():
            got = torch.compile(model, backend="torch_stage", options=options)(x)
        ref = model(x)
    assert type(got) is type(ref)
    assert torch.equal(got.last_hidden_state, expected.last_hidden_state)
    torch.testing.assert_close(got.last_hidden_state, ref.last_hidden_state)


def test_without_example_inputs_the_error_says_to_give_them():
    with pytest.raises(torch_stage.MultiStreamTraceError, match="example_inputs"):
        torch_stage.multi_stream(build("bert"))


def test_annotations_are_not_dropped_silently_by_the_export_fallback():
    class Annotated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            # Symbolic tracing cannot make an int of a traced size; export can.
            rows = int(x.shape[0])
            with torch_stage.stream(1):
                y = self.a(x)
            return y + self.b(x) + x.new_zeros(rows, 4)

    x = torch.ones(2, 4)
    with pytest.raises(torch_stage.MultiStreamTraceError, match="does not keep its"):
        torch_stage.multi_stream(Annotated(), example_inputs=(x,))


@pytest.mark.parametrize("name", MODELS)
def test_three_sgd_steps_on_inductor_match_inductor_alone_and_eager(name):
    def train(model, compiled):
        # SGD: Adam's step is lr times the gradient's sign wherever the
        # gradient is tiny, so any two compilers' rounding moves those
        # weights by lr.
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(3):
            opt.zero_grad()
            compiled(ids(2, 16, seed=step)).last_hidden_state.square().mean().backward()
            opt.step()

    eager = build(name).train()
    ours, alone = copy.deepcopy(eager), copy.deepcopy(eager)
    torch._dynamo.reset()
    train(ours, torch.compile(ours, backend=torch_stage.backend(num_streams=4)))
    torch._dynamo.reset()
    train(alone, torch.compile(alone))
    torch._dynamo.reset()
    train(eager, eager)
    # (Not bit for bit: inductor's CPU code for an embedding's backward adds
    # up rows in parallel, so two compiles of the same graph differ in the
    # last bits too.)
    for (key, p), q, r in zip(alone.named_parameters(), ours.parameters(), eager.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=key)
        torch.testing.assert_close(q, r, rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("name", MODELS)
def test_the_stream_program_inductor_gets_trains_race_free(name, emulated):
    # PyTorch's stream passes run as on a GPU (tests/compiled_streams.py):
    # the program AOTAutograd makes of the plan, forward and backward, run
    # op by op under the stream sanitizer, equal to eager.
    eager = build(name).train()
    ours = copy.deepcopy(eager)
    backend = torch_stage.backend(num_streams=4, executor="aot_eager")
    compiled = torch.compile(ours, backend=backend)
    x = ids(2, 16)
    compiled(x).last_hidden_state.square().mean().backward()  # compiles
    ours.zero_grad()
    with torch_stage.sanitize_streams() as sanitizer:
        got = compiled(x).last_hidden_state
        got.square().mean().backward()
    assert sanitizer.races == []
    expected = eager(x).last_hidden_state
    expected.square().mean().backward()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    for (key, p), q in zip(eager.named_parameters(), ours.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=key)
    assert any(len(p.streams_used) > 1 for p in backend.plans), backend.plans


@pytest.mark.parametrize("name", MODELS)
def test_a_model_captured_by_export_scripts_saves_loads_and_equals_eager(name, tmp_path):
    # TorchScript cannot compile export's calling convention (pytree in and
    # out) nor its input-guard module: the plan scripts as its flat graph,
    # the inputs in order and the outputs as a tuple, as Hugging Face's own
    # torchscript=True models return them.
    model = build(name)
    x = ids(2, 16)
    rewritten = torch_stage.multi_stream(model, num_streams=4, example_inputs=(x,))
    assert len(rewritten.stream_plan.streams_used) >= 3
    scripted = torch.jit.script(rewritten)
    path = str(tmp_path / f"{name}.pt")
    torch.jit.save(scripted, path)
    loaded = torch.jit.load(path)
    other = ids(3, 9, seed=1)
    with torch.no_grad():
        for inputs in (x, other):
            ref = model(inputs).to_tuple()
            for module in (scripted, loaded):
                out = module(inputs)
                assert isinstance(out, tuple) and len(out) == len(ref)
                for got, want in zip(out, ref):
                    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # The Python module is unchanged by scripting: same output type.
    with torch.no_grad():
        assert type(rewritten(x)) is type(model(x))
    # Its stream ops are in the scripted code.
    assert "torch_stage.fork" in scripted.code or "torch_stage::fork" in str(scripted.graph)
