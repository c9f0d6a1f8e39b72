"""kernels/direct_kernel_calls.py: our Triton kernel calls rewritten into their mutating form without tracing.

The CPU tests compile, with Inductor's Triton backend for CPU tensors (the graph passes are the same as for CUDA;
nothing here can run the kernels, so the compiled call fails after the passes and is ignored), functions that call
small user-defined Triton kernels through triton_op / wrap_triton, and record the graph torch's
`decompose_triton_kernel_wrapper_functional` returns: with the rewrite in front of it and without, the graphs are
the same, node for node, targets, arguments and the metadata Inductor reads (the value, the eager input values,
the stack trace). A call that clones or whose result is read (a graph built by hand), and a kernel not of this
package, are left to torch's pass.
The GPU test compiles a SwitchBack layer and checks that every call of our kernels was rewritten and that the
layer computes what it computes with torch's pass.
"""

import contextlib
import operator

import pytest
import torch

from hf_switchback.kernels import direct_kernel_calls, kernel_access

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
post_grad = pytest.importorskip("torch._inductor.fx_passes.post_grad")


@kernel_access.declare_access(reads=("x_ptr",), writes=("y_ptr",))
@triton.jit
def _plus_one_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


@torch.library.triton_op("hf_switchback_test::plus_one", mutates_args=())
def plus_one(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)  # a fresh output, as every op of ours allocates
    torch.library.wrap_triton(_plus_one_kernel)[(triton.cdiv(x.numel(), 64),)](x, y, x.numel(), BLOCK=64)
    return y


def _step(x):
    a = plus_one(x * 2)
    return plus_one(a) * 3 + a


@pytest.fixture
def restored():
    """Leave the rewrite and the declarations installed or not as the test found them."""
    was = direct_kernel_calls.is_installed()
    declarations_were = kernel_access.is_installed()
    direct_kernel_calls.uninstall()
    yield
    direct_kernel_calls.uninstall()
    if was:
        direct_kernel_calls.install()
    if not declarations_were:
        kernel_access.uninstall()


def _decomposed(fn, x, monkeypatch) -> list[tuple]:
    """The graph after the post-grad decomposition of fn's compile: (target, args, kwargs, meta) per node."""
    import torch._inductor.config as inductor_config
    import torch.utils._triton as torch_triton
    from torch._inductor.async_compile import AsyncCompile

    monkeypatch.setattr(torch_triton, "triton_hash_with_backend", lambda: "cpu-test")  # no GPU driver here
    monkeypatch.setattr(AsyncCompile, "triton", lambda self, *args, **kwargs: None)  # nothing compiles
    assert (
        kernel_access.install()
    )  # declared writes: torch's analysis needs a GPU target (the fixture restores)
    graphs = []
    decompose = post_grad.decompose_triton_kernel_wrapper_functional

    errors = []

    def recording(graph, *args, **kwargs):
        result = decompose(graph, *args, **kwargs)
        try:
            graphs.append([_node_summary(node) for node in graph.nodes])
        except Exception as error:  # raised below: the compile's own failure is suppressed
            errors.append(error)
        return result

    # (put back at once, not at the test's end: the test may install the rewrite in front of torch's pass next)
    post_grad.decompose_triton_kernel_wrapper_functional = recording
    torch._dynamo.reset()
    try:
        with (
            inductor_config.patch(cpu_backend="triton", compile_threads=1, force_disable_caches=True),
            contextlib.suppress(
                Exception
            ),  # the kernels cannot run on this machine: the graph is what is tested
        ):
            torch.compile(fn)(x)
    finally:
        post_grad.decompose_triton_kernel_wrapper_functional = decompose
        torch._dynamo.reset()
    if errors:
        raise errors[0]
    assert len(graphs) == 1, graphs
    return graphs[0]


def _value(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype)
    if isinstance(value, dict):
        return {key: _value(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):  # (a named tuple, e.g. tensor_meta, as its name and fields)
        return (type(value).__name__, *(_value(v) for v in value))
    if isinstance(value, torch.fx.Node):
        return ("node", value.name)
    if isinstance(value, torch._ops.OpOverload):  # (compares by identity)
        return str(value)
    return value


def _node_summary(node) -> tuple:
    # every metadata field but the provenance record, which names the compile's graph objects
    meta = {key: _value(value) for key, value in node.meta.items() if key != "from_node"}
    return (node.op, str(node.target), _value(node.args), _value(dict(node.kwargs)), meta)


def _mutations(graph: list[tuple]) -> list[tuple]:
    return [node for node in graph if node[1] == "triton_kernel_wrapper_mutation"]


def test_rewritten_calls_give_the_graph_torchs_pass_gives(restored, monkeypatch):
    x = torch.randn(100)
    torchs = _decomposed(_step, x, monkeypatch)
    monkeypatch.setattr(
        direct_kernel_calls, "of_this_package", lambda kernel_idx: True
    )  # the test's kernel as ours
    assert direct_kernel_calls.install()
    ours = _decomposed(_step, x, monkeypatch)
    assert direct_kernel_calls.stats["rewritten"] == 2
    assert len(_mutations(torchs)) == 2
    assert ours == torchs


def test_a_call_of_another_form_is_left_to_torch(monkeypatch):
    """Calls whose functional form torch must keep some of (a clone, a result read after), or that differ from
    the known form, stay as they are."""
    monkeypatch.setattr(direct_kernel_calls, "of_this_package", lambda kernel_idx: True)
    functional = torch.ops.higher_order.triton_kernel_wrapper_functional
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    common = dict(kernel_idx=0, constant_args_idx=0, grid=[(1, 1, 1)], tma_descriptor_metadata={})
    eager = ((), {**dict.fromkeys(common), "kwargs": {"x_ptr": None}, "tensors_to_clone": []})

    def call(args=(), **kwargs):
        node = graph.call_function(functional, args, kwargs={**common, "kwargs": {"x_ptr": x}, **kwargs})
        node.meta["eager_input_vals"] = eager
        return node

    cloning = call(tensors_to_clone=["x_ptr"])
    read = call(tensors_to_clone=[])
    call((x,), tensors_to_clone=[])  # positional arguments
    call(tensors_to_clone=[], extra=1)  # an argument the known form lacks
    call(tensors_to_clone=[]).meta.pop(
        "eager_input_vals"
    )  # nothing to carry over as torch's replacement does
    graph.output(graph.call_function(operator.getitem, (read, "x_ptr")))
    before = [(node.target, node.args, dict(node.kwargs)) for node in graph.nodes]
    assert direct_kernel_calls.rewrite_calls(graph) == 0
    assert [
        (node.target, node.args, dict(node.kwargs)) for node in graph.nodes
    ] == before and cloning in graph.nodes
    # the same call in the known form is rewritten: the cases above differ from it in one thing each
    call(tensors_to_clone=[])
    assert direct_kernel_calls.rewrite_calls(graph) == 1


def test_a_kernel_of_another_package_is_left_to_torch(restored, monkeypatch):
    x = torch.randn(100)
    answers = []
    is_ours = direct_kernel_calls.of_this_package
    monkeypatch.setattr(
        direct_kernel_calls, "of_this_package", lambda idx: answers.append(is_ours(idx)) or answers[-1]
    )
    assert direct_kernel_calls.install()
    _decomposed(_step, x, monkeypatch)
    # asked for both calls and answered no (this test module's kernel is not this package's): nothing rewritten
    assert answers == [False, False] and direct_kernel_calls.stats["rewritten"] == 0


def test_the_switch_leaves_torchs_pass_alone(restored, monkeypatch):
    original = post_grad.decompose_triton_kernel_wrapper_functional
    monkeypatch.setenv("HF_SWITCHBACK_DIRECT_KERNEL_CALLS", "0")
    assert not direct_kernel_calls.install()
    assert post_grad.decompose_triton_kernel_wrapper_functional is original


def test_install_once_and_uninstall_restores_torchs_pass(restored):
    original = post_grad.decompose_triton_kernel_wrapper_functional
    assert direct_kernel_calls.install() and direct_kernel_calls.install()
    assert post_grad.decompose_triton_kernel_wrapper_functional.hf_switchback_original is original
    direct_kernel_calls.uninstall()
    assert post_grad.decompose_triton_kernel_wrapper_functional is original


def test_a_failed_rewrite_leaves_the_graph_to_torchs_pass(restored, monkeypatch):
    """The kernel table unreadable, or the eager values of another form: every call is torch's pass's, once."""
    x = torch.randn(100)
    torchs = _decomposed(_step, x, monkeypatch)

    def refuse(kernel_idx):
        raise RuntimeError("no kernel table")

    monkeypatch.setattr(direct_kernel_calls, "of_this_package", refuse)
    assert direct_kernel_calls.install()
    assert _decomposed(_step, x, monkeypatch) == torchs and direct_kernel_calls.stats["rewritten"] == 0
    monkeypatch.setattr(direct_kernel_calls, "of_this_package", lambda kernel_idx: True)
    # the new node's metadata fails to build (a field the eager values lack): the call stays whole
    monkeypatch.setattr(
        direct_kernel_calls, "_MUTATION_KWARGS", (*direct_kernel_calls._MUTATION_KWARGS, "absent")
    )
    decomposed = _decomposed(_step, x, monkeypatch)
    assert decomposed == torchs and len(_mutations(decomposed)) == 2
    assert direct_kernel_calls.stats["rewritten"] == 0


@pytest.mark.gpu
def test_gpu_a_compiled_layer_rewrites_every_call_of_our_kernels(restored, monkeypatch):
    from test_ttir_cache import compiled_step, small_layer_and_input

    layer, x = small_layer_and_input()
    monkeypatch.setenv("HF_SWITCHBACK_DIRECT_KERNEL_CALLS", "0")  # (the first trace would install it)
    torchs = compiled_step(layer, x)
    monkeypatch.delenv("HF_SWITCHBACK_DIRECT_KERNEL_CALLS")
    assert direct_kernel_calls.install()
    left = []
    decompose = direct_kernel_calls.front.ours.hf_switchback_original

    def counting(graph, *args, **kwargs):
        functional = torch.ops.higher_order.triton_kernel_wrapper_functional
        left.extend(
            node.kwargs["kernel_idx"] for node in graph.find_nodes(op="call_function", target=functional)
        )
        return decompose(graph, *args, **kwargs)

    monkeypatch.setattr(direct_kernel_calls.front.ours, "hf_switchback_original", counting)
    ours = compiled_step(layer, x)
    assert direct_kernel_calls.stats["rewritten"] >= 10 and left == [], (direct_kernel_calls.stats, left)
    for got, want in zip(ours, torchs, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-3)
