"""What several test files share: SNR, tiny CLIP configs, free ports, loading scripts, GPU checks, a kernel spy.

Test files import it as `from helpers import ...` (pytest puts tests/ on sys.path through its conftest.py).
"""

from __future__ import annotations

import importlib.util
import math
import socket
import sys
from pathlib import Path
from types import ModuleType

import torch

REPO = Path(__file__).resolve().parent.parent
HAS_TRITON = importlib.util.find_spec("triton") is not None
# What `@pytest.mark.gpu` tests need (conftest.py skips them elsewhere).
HAS_GPU = HAS_TRITON and torch.cuda.is_available()


def _triton_version() -> tuple[int, ...]:
    import triton

    return tuple(int(part) for part in triton.__version__.split(".")[:2])


# TRITON_INTERPRET=1 runs our kernels on the CPU from triton 3.9 on; older interpreters fail on a runtime loop
# bound (not a scalar there) and emulate tl.fma unfused. The GPU tests cover the compiled kernels.
CAN_INTERPRET_KERNELS = HAS_TRITON and _triton_version() >= (3, 9)
INTERPRETER_SKIP_REASON = (
    "needs triton >= 3.9 (TRITON_INTERPRET=1 runs the kernels on the CPU; older interpreters cannot run them); "
    "the GPU tests cover the compiled kernels"
)


def snr_db(exact: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-noise ratio of `approx` against `exact`, 10 log10(|exact|² / |exact - approx|²) in dB, over
    the whole tensor in float64 (inf when equal)."""
    noise = (exact.double() - approx.double()).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(exact.double().pow(2).sum().item() / noise)


def tiny_clip_config(
    layers: int = 2,
    hidden: int = 32,
    image_size: int = 16,
    patch_size: int = 8,
    bos: int = 0,
    eos: int = 1,
    pad: int = 1,
    vocab: int = 64,
):
    """A CLIPConfig small enough for CPU tests: both towers, `layers` encoder layers each; bos / eos / pad are
    the text tower's special token ids (a tokenizer's, when the test has one)."""
    from transformers import CLIPConfig

    tower = dict(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=2
    )
    text = dict(
        tower,
        vocab_size=vocab,
        max_position_embeddings=16,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    vision = dict(tower, image_size=image_size, patch_size=patch_size)
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)


def tiny_siglip_pair_config():
    """A SiglipConfig with two small towers of 2 layers (hidden 32), the size of tiny_clip_config(hidden=64)'s."""
    from transformers import SiglipConfig

    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    text = dict(
        tower, vocab_size=64, max_position_embeddings=16, bos_token_id=2, eos_token_id=3, pad_token_id=0
    )
    return SiglipConfig(text_config=text, vision_config=dict(tower, patch_size=8, image_size=16))


def tiny_pair_model(kind: str):
    """A seeded tiny CLIPModel ("clip") or SiglipModel ("siglip") for block-level comparisons."""
    from transformers import CLIPModel, SiglipModel

    torch.manual_seed(0)
    return (
        CLIPModel(tiny_clip_config(hidden=64)) if kind == "clip" else SiglipModel(tiny_siglip_pair_config())
    )


def tiny_pair_inputs(batch: int = 4, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A seeded text + image batch for tiny_pair_model: bos ... eos token ids (CLIP pools at eos), 16 x 16 images."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 60, (batch, 12), generator=g)
    ids[:, 0], ids[:, -1] = 0, 1
    inputs = {"input_ids": ids, "pixel_values": torch.randn(batch, 3, 16, 16, generator=g)}
    return {k: v.to(device) for k, v in inputs.items()}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_script(path: str | Path, name: str | None = None) -> ModuleType:
    """Import a script (examples/, benchmarks/; a path relative to the repository) as a module named `name`
    (default: the file's stem), without running its __main__ block. Registered in sys.modules, as dataclasses
    and pickling need."""
    path = Path(path) if Path(path).is_absolute() else REPO / path
    name = name or path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class KernelSpy:
    """Records every kernel call the SwitchBack autograd functions make: (function name, options it got).

    install() wraps `functional.get_kernels`, so the calls are the ones functional.py makes, whatever kernel
    set (reference, Triton) serves them. Eager mode only (under torch.compile the calls happen while a graph is
    traced, once, not per step).
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    @classmethod
    def install(cls, monkeypatch) -> KernelSpy:
        from hf_switchback import functional

        spy, get_kernels = cls(), functional.get_kernels
        monkeypatch.setattr(functional, "get_kernels", lambda *args: _Recording(get_kernels(*args), spy))
        return spy

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


class _Recording:
    def __init__(self, kernels, spy: KernelSpy) -> None:
        self._kernels, self._spy = kernels, spy

    def __getattr__(self, name: str):
        fn = getattr(self._kernels, name)

        def record(*args, **kwargs):
            self._spy.calls.append((name, kwargs.get("options")))
            return fn(*args, **kwargs)

        return record
