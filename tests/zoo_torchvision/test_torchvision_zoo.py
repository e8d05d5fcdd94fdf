"""Multi-stream on real models: torchvision's classification models, built
from their configs without weights, rewritten by torch_stage.multi_stream and
run under the stream sanitizer.

Needs torchvision, which must match the pinned torch: `make zoo` makes a
venv of its own for it (torch 2.14.1 + torchvision 0.29.1: PyPI's
torchvision does not load beside the CPU build of torch 2.13 that `make
test` uses), installs torch_stage there and runs this module. Without
torchvision it is skipped.
"""

import copy
import os
import subprocess

import pytest
import torch

torchvision = pytest.importorskip("torchvision")

from stream_oracle import waits, without_wait  # noqa: E402

import torch_stage  # noqa: E402
from torch_stage.streams.fx.cost_model import is_view, may_copy  # noqa: E402
from torch_stage.streams.fx.host_cost import HostCosts, planning_with  # noqa: E402

#: The C++ runner (tests/zoo_torchvision/cpp), built and named by make zoo.
RUNNER_ENV = "TORCH_STAGE_ZOO_RUNNER"

# The smallest model of each family (the large ones repeat the same blocks),
# with the input size it accepts.
MODELS = {
    "alexnet": 64,
    "convnext_tiny": 64,
    "densenet121": 64,
    "efficientnet_b0": 64,
    "efficientnet_v2_s": 64,
    "googlenet": 64,
    "inception_v3": 80,
    "maxvit_t": 224,
    "mnasnet0_5": 64,
    "mobilenet_v2": 64,
    "mobilenet_v3_small": 64,
    "regnet_x_400mf": 64,
    "regnet_y_400mf": 64,
    "resnet18": 64,
    "resnext50_32x4d": 64,
    "shufflenet_v2_x0_5": 64,
    "squeezenet1_0": 64,
    "swin_t": 64,
    "swin_v2_t": 64,
    "vgg11_bn": 64,
    "vit_b_32": 224,
    "wide_resnet50_2": 64,
}


def _build(name):
    torch.manual_seed(0)
    kwargs = {"weights": None}
    if name in ("googlenet", "inception_v3"):
        kwargs.update(aux_logits=False, init_weights=False)
    return torchvision.models.get_model(name, **kwargs)


def _input(name, batch=2):
    size = MODELS[name]
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def rewritten():
    cache = {}

    def get(name):
        if name not in cache:
            model = _build(name).eval()
            cache[name] = (model, torch_stage.multi_stream(copy.deepcopy(model), num_streams=4))
        return cache[name]

    return get


def _one_sgd_step_each(reference, ms, x):
    """A training step (forward, backward, SGD with momentum) of each from
    the same random state, the multi-stream one under the sanitizer:
    (reference output, multi-stream output, races)."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (reference, ms)]
    torch.manual_seed(2)
    expected = reference(x)
    expected.logsumexp(1).sum().backward()
    opts[0].step()
    torch.manual_seed(2)
    with torch_stage.sanitize_streams() as sanitizer:
        got = ms(x)
        got.logsumexp(1).sum().backward()
        opts[1].step()
    return expected, got, sanitizer.races


@pytest.mark.parametrize("name", sorted(MODELS))
def test_eval_is_race_free_and_bit_identical(name, rewritten):
    model, ms = rewritten(name)
    x = _input(name)
    with torch.no_grad():
        expected = model(x)
        with torch_stage.sanitize_streams() as sanitizer:
            got = ms(x)
    assert sanitizer.races == []
    assert torch.equal(got, expected)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_training_step_is_race_free_and_equals_the_same_graph_on_one_stream(name, rewritten):
    # The reference is the traced graph run as is (torch.fx, one stream):
    # for a few models (swin, maxvit: PatchMerging) torch.fx's trace itself
    # gives other gradients than eager Python, with or without torch_stage;
    # the forward is compared with eager too.
    model, _ = rewritten(name)
    traced = torch.fx.symbolic_trace(copy.deepcopy(model).train())
    ms = torch_stage.multi_stream(copy.deepcopy(model).train(), num_streams=4)
    x = _input(name)
    expected, got, races = _one_sgd_step_each(traced, ms, x)
    assert races == []
    assert torch.equal(got, expected)
    torch.manual_seed(2)
    assert torch.equal(got, copy.deepcopy(model).train()(x))
    # BatchNorm running stats too. torch.fx's default trace holds a buffer
    # that forward reads alone (maxvit's relative position index) as a
    # _tensor_constant; torch_stage's trace reads the buffer itself.
    ref, ours = traced.state_dict(), ms.state_dict()
    assert all(k.startswith("_tensor_constant") for k in ref.keys() - ours.keys())
    for k in ref.keys() & ours.keys():
        assert torch.equal(ref[k], ours[k]), k


# A host that launches faster than the cost model's nominal kernels run,
# with a GPU's calls: where the model finds it faster, plans share calls
# within a stream and are issued stream by stream
# (torch_stage/streams/fx/calls.py), which the measured CPU costs of the
# tests above never choose.
_FAST_LAUNCHES = HostCosts(
    launch_us=2.0, fork_join_us=4.0, sync_us=2.0, record_us=1.5, wait_us=1.5, keep_us=0.5
)


def test_plans_issued_stream_by_stream_are_race_free_and_bit_identical():
    reordered, shared = [], []
    for name in sorted(MODELS):
        model = _build(name).eval()
        with planning_with(_FAST_LAUNCHES):
            ms = torch_stage.multi_stream(copy.deepcopy(model), num_streams=4)
        if "issued stream by stream" in ms.stream_plan.note:
            reordered.append(name)
        if "shared within a stream" in ms.stream_plan.note:
            shared.append(name)
        x = _input(name)
        with torch.no_grad():
            expected = model(x)
            with torch_stage.sanitize_streams() as sanitizer:
                got = ms(x)
        assert sanitizer.races == [], name
        assert torch.equal(got, expected), name
        # A training step too, against the same graph on one stream.
        traced = torch.fx.symbolic_trace(copy.deepcopy(model).train())
        expected, got, races = _one_sgd_step_each(traced, ms.train(), x)
        assert races == [], name
        assert torch.equal(got, expected), name
    # The test proves something only where plans were reordered or share
    # calls (the costs are given: the same plans each run).
    assert reordered == ["inception_v3", "maxvit_t"], reordered
    assert shared, shared


# The models whose forward reads self.training as a value (torchvision's
# stochastic_depth): tracing freezes it, so the plan must follow train().
_MODE_READERS = ["convnext_tiny", "efficientnet_b0", "maxvit_t", "swin_t"]


@pytest.mark.parametrize("name", _MODE_READERS)
def test_a_plan_made_in_eval_trains_like_the_graph_traced_in_training(name, rewritten):
    model, ms = rewritten(name)
    ms = copy.deepcopy(ms).train()
    traced = torch.fx.symbolic_trace(copy.deepcopy(model).train())
    x = _input(name)
    torch.manual_seed(2)
    expected = traced(x)
    torch.manual_seed(2)
    with torch_stage.sanitize_streams() as sanitizer:
        got = ms(x)
    assert sanitizer.races == []
    assert torch.equal(got, expected)
    # And back: eval again skips stochastic depth (the running statistics
    # that the training forward updated are the copy's own).
    reference = copy.deepcopy(model)
    # (MaxViT's relative_position_index buffers are graph constants there.)
    result = reference.load_state_dict(ms.state_dict(), strict=False)
    assert all(k.endswith("relative_position_index") for k in result.missing_keys), result
    with torch.no_grad():
        assert torch.equal(ms.eval()(x), reference(x))


def test_plans_look_like_what_an_expert_would_write(rewritten):
    plan = rewritten("alexnet")[1].stream_plan
    assert (len(plan.streams_used), len(plan.events)) == (1, 0)  # a chain
    plan = rewritten("vgg11_bn")[1].stream_plan
    assert (len(plan.streams_used), len(plan.events)) == (1, 0)
    plan = rewritten("googlenet")[1].stream_plan
    assert len(plan.streams_used) == 4  # inception branches spread over the pool


@pytest.mark.parametrize("name", sorted(MODELS))
def test_views_identities_getitems_and_asserts_get_no_stream_or_event(name, rewritten):
    _, ms = rewritten(name)
    plan = ms.stream_plan
    nodes = {n.name: n for n in ms.graph.nodes}
    trivial = {
        n
        for n, node in nodes.items()
        if (is_view(node) and not may_copy(node))
        or node.target is torch._assert
        or (
            node.op == "call_module"
            and isinstance(ms.get_submodule(node.target), torch.nn.Identity)
        )
    }
    assert trivial & set(plan.assignment) == set()
    assert trivial & {e.node for e in plan.events} == set()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_scripts_saves_and_loads_when_eager_scripts(name, rewritten, tmp_path):
    model, ms = rewritten(name)
    try:
        torch.jit.script(model)
    except Exception as e:  # noqa: BLE001  the model itself does not script
        pytest.skip(f"{name} does not script in eager either: {type(e).__name__}")
    scripted = torch.jit.script(ms)
    path = os.path.join(tmp_path, f"{name}.pt")
    scripted.save(path)
    loaded = torch.jit.load(path)
    x = _input(name)
    with torch.no_grad():
        with torch_stage.sanitize_streams() as sanitizer:
            got = loaded(x)
        assert sanitizer.races == []
        expected = model(x)
        assert torch.equal(got, expected)
    # And from C++, with LibTorch and libtorch_stage.so alone.
    runner = os.environ.get(RUNNER_ENV)
    if not runner:
        pytest.skip(f"{RUNNER_ENV} is not set (make zoo builds the C++ runner and sets it)")
    case = os.path.join(tmp_path, f"{name}-case.pt")
    torch.save((x, expected), case)
    library = os.path.join(os.path.dirname(torch_stage.__file__), "lib", "libtorch_stage.so")
    proc = subprocess.run(
        [runner, library, path, case, str(torch.get_num_threads())],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (proc.returncode, proc.stdout.strip()) == (0, "equal"), proc.stdout + proc.stderr


@pytest.mark.parametrize("name", ["googlenet", "inception_v3"])
def test_every_wait_removal_that_breaks_a_dependency_is_reported(name, rewritten):
    # Removing a wait is reported exactly when it leaves a data dependency
    # between streams unordered (tests/stream_oracle.py); a few waits of
    # Inception3's plan order nothing (a planner inefficiency), and their
    # removal must report nothing.
    _, ms = rewritten(name)
    removals = waits(ms)
    assert len(removals) >= 8
    x = _input(name)
    wrong = []
    reported = 0
    for wait in removals:
        mutant, conflict = without_wait(ms, wait)
        with torch.no_grad(), torch_stage.sanitize_streams(raise_on_race=False) as sanitizer:
            mutant(x)
        found = [r for r in sanitizer.races if r.kind != "free while in use"]
        reported += bool(found)
        if bool(found) != conflict:
            wrong.append((wait, conflict, [str(r) for r in found]))
    assert wrong == []
    assert reported >= len(removals) // 2


# --- On a GPU: real streams, real events, and PyTorch's own stream sanitizer.
# On CPU the stream ops do nothing, so the tests above can only show a plan
# safe under torch_stage's model of CUDA semantics. Here the plan runs on
# CUDA streams, is checked by that model and, with TORCH_CUDA_SANITIZER=1 in
# the environment, by torch.cuda._sanitizer (CSAN) as well, which sees the
# kernels and the event records and waits the driver is asked for.


def _cuda_tolerances():
    # Same kernels in the same order on each stream; what may differ is the
    # order of atomic adds in a few backward kernels (not cuDNN's: set
    # deterministic below), far below these bounds after one SGD step.
    return {"rtol": 1e-4, "atol": 1e-5}


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(MODELS))
def test_on_cuda_eval_and_a_training_step_on_four_streams_match_one_stream(name, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    model = _build(name).cuda().eval()
    x = _input(name).cuda()
    ms = torch_stage.multi_stream(copy.deepcopy(model), num_streams=4)
    with torch.no_grad():
        expected = model(x)
        with torch_stage.sanitize_streams() as sanitizer:
            got = ms(x)
    assert sanitizer.races == []
    torch.testing.assert_close(got, expected, **_cuda_tolerances())

    # The same rewritten module switched to training mode: where tracing
    # froze the mode (stochastic depth) it plans again (see the test above).
    traced = torch.fx.symbolic_trace(copy.deepcopy(model).train())
    expected, got, races = _one_sgd_step_each(traced, ms.train(), x)
    torch.cuda.synchronize()
    assert races == []
    torch.testing.assert_close(got, expected, **_cuda_tolerances())
    # By name, as on CPU: fx's trace holds maxvit's index buffer as a
    # _tensor_constant, torch_stage's reads the buffer itself.
    ref, ours = traced.state_dict(), ms.state_dict()
    assert all(k.startswith("_tensor_constant") for k in ref.keys() - ours.keys())
    for k in ref.keys() & ours.keys():
        torch.testing.assert_close(ours[k], ref[k], **_cuda_tolerances(), msg=k)


# Run in a process of its own: CSAN is one process-wide dispatch mode whose
# callbacks cannot be unregistered. Enabled there after one change
# (tests/torch_csan.py): empty tensors, which CSAN keys by a Python id that
# a later object reuses, are left out.
_CSAN_MUTANTS = """
import copy, json, sys
import torch
import torch.cuda._sanitizer as csan
import torchvision
sys.path.insert(0, {tests!r})
from stream_oracle import waits, without_wait
from torch_csan import ignore_empty_tensors
import torch_stage

ignore_empty_tensors()
csan.enable_cuda_sanitizer()
torch.manual_seed(0)
kwargs = dict(weights=None, aux_logits=False, init_weights=False)
model = torchvision.models.get_model({name!r}, **kwargs).cuda().eval()
ms = torch_stage.multi_stream(copy.deepcopy(model), num_streams=4)
x = torch.randn(2, 3, {size}, {size}, device="cuda")
with torch.no_grad():
    ms(x)  # the plan as made: CSAN must find nothing (else this raises)
torch.cuda.synchronize()
out = []
for wait in waits(ms):
    mutant, conflict = without_wait(ms, wait)
    try:
        with torch.no_grad():
            mutant(x)
        found = False
    except csan.CUDASanitizerErrors:
        found = True
    torch.cuda.synchronize()  # CSAN: every stream is ordered after this
    out.append([list(wait), conflict, found])
print(json.dumps({{"results": out}}))
"""


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["googlenet", "inception_v3"])
def test_on_cuda_torchs_own_sanitizer_reports_exactly_the_removed_waits_that_matter(
    name, run_python
):
    # The plan as made runs clean under CSAN; then each of its waits is
    # removed in turn. CSAN, which knows nothing of torch_stage, must report
    # a race exactly where the oracle (tests/stream_oracle.py) says the
    # removal leaves a data dependency between two streams unordered: the
    # waits the planner emits are the ones the GPU needs.
    import json

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = _CSAN_MUTANTS.format(tests=tests, name=name, size=MODELS[name])
    # Not inherited: torch enables CSAN at import when the variable is set
    # at all, before the script could make its change.
    proc = run_python(code, timeout=600, env={"TORCH_CUDA_SANITIZER": None})
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    results = report["results"]
    assert len(results) >= 8
    wrong = [(wait, conflict, found) for wait, conflict, found in results if conflict != found]
    assert wrong == []
    assert sum(found for _, _, found in results) >= len(results) // 2


# -- the compile backend on inductor --------------------------------------

# Two branchy models and a chain: compiling a training graph with inductor
# costs a minute or more a model on this CPU, so not every family.
_INDUCTOR = ["googlenet", "inception_v3", "mobilenet_v3_small"]


# A bound against hangs, not a time to meet: with inductor's cache cold (a
# fresh machine), inception_v3's four compiles (training and eval, ours and
# inductor's) took 318 s on 2 cores, over the suite's 300 s (39 s warm).
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", _INDUCTOR)
def test_the_backend_on_inductor_equals_inductor_alone_and_eager(name):
    # The CPU has no streams: the backend gives inductor Dynamo's graph as
    # it is, so three SGD steps and the eval output equal inductor's bit for
    # bit, and the eval output equals eager's within float tolerance of its
    # scale. (Training is not compared with eager: over batch norm of a
    # batch of two 2x2 maps, inductor's gradients differ from eager's by up
    # to 3% of their norm on inception_v3, with or without torch_stage;
    # dropout's random numbers are inductor's own. After those steps
    # inception_v3's logits reach 8e4, and on an AVX-512 CPU inductor's
    # differ from eager's by up to 0.09 there, 1e-6 of that scale, with or
    # without torch_stage.)
    def train(model, compiled):
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        for step in range(3):
            torch.manual_seed(2 + step)
            opt.zero_grad()
            compiled(x).logsumexp(1).sum().backward()
            opt.step()

    eager = _build(name).train()
    ours, alone = copy.deepcopy(eager), copy.deepcopy(eager)
    x = _input(name)
    torch._dynamo.reset()
    backend = torch_stage.backend(num_streams=4)
    compiled = torch.compile(ours, backend=backend)
    train(ours, compiled)
    torch._dynamo.reset()
    inductor = torch.compile(alone)
    train(alone, inductor)
    for (key, p), q in zip(alone.named_parameters(), ours.parameters()):
        assert torch.equal(q, p), key
    eager.load_state_dict(ours.state_dict())
    with torch.no_grad():
        got = compiled.eval()(x)
        assert torch.equal(got, inductor.eval()(x))
        expected = eager.eval()(x)
        scale = expected.abs().max().item()
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=max(1e-3, 1e-5 * scale))
    torch._dynamo.reset()
    assert backend.plans and all(p.note for p in backend.plans)


# Every kind of block among the families: branches, dense concatenation,
# squeeze-excite, stochastic depth, channel shuffle, window attention, a
# transformer, layer scale.
_PROGRAMS = [
    "convnext_tiny",
    "densenet121",
    "efficientnet_b0",
    "googlenet",
    "inception_v3",
    "mobilenet_v3_small",
    "regnet_y_400mf",
    "resnet18",
    "shufflenet_v2_x0_5",
    "squeezenet1_0",
    "swin_v2_t",
    "vit_b_32",
]


@pytest.mark.parametrize("name", _PROGRAMS)
def test_the_stream_program_inductor_gets_trains_race_free(name, emulated):
    # With PyTorch's stream passes run as on a GPU (tests/compiled_streams.py),
    # the program AOTAutograd makes of the backend's plan, forward and
    # backward, run op by op under the stream sanitizer.
    eager = _build(name).train()
    ours = copy.deepcopy(eager)
    x = _input(name)
    backend = torch_stage.backend(num_streams=4, executor="aot_eager")
    compiled = torch.compile(ours, backend=backend)
    torch.manual_seed(2)
    compiled(x).logsumexp(1).sum().backward()  # compiles
    ours.zero_grad()
    torch.manual_seed(2)
    with torch_stage.sanitize_streams() as sanitizer:
        got = compiled(x)
        got.logsumexp(1).sum().backward()
    assert sanitizer.races == []
    torch.manual_seed(2)
    expected = eager(x)
    expected.logsumexp(1).sum().backward()
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-4)
    for (key, p), q in zip(eager.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-4, msg=key)
    assert len(backend.plans) == len(backend.graphs)
