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
from torch_stage.fx.cost_model import is_view, may_copy  # noqa: E402

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
    opts = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (traced, ms)]
    torch.manual_seed(2)
    expected = traced(x)
    expected.logsumexp(1).sum().backward()
    opts[0].step()
    torch.manual_seed(2)
    with torch_stage.sanitize_streams() as sanitizer:
        got = ms(x)
        got.logsumexp(1).sum().backward()
        opts[1].step()
    assert sanitizer.races == []
    assert torch.equal(got, expected)
    torch.manual_seed(2)
    assert torch.equal(got, copy.deepcopy(model).train()(x))
    for (k, a), (_, b) in zip(traced.state_dict().items(), ms.state_dict().items()):
        assert torch.equal(a, b), k  # BatchNorm running stats too


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
