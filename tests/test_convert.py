"""apply_switchback / remove_switchback on tiny Hugging Face CLIP models (built from configs, no download)."""

import logging

import pytest
import torch
from helpers import tiny_clip_config
from torch import nn
from transformers import CLIPModel, CLIPTextModel, CLIPVisionModel

from hf_switchback import SwitchBackConfig, SwitchBackLinear, apply_switchback, remove_switchback
from hf_switchback.kernels import backends

PER_LAYER = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.out_proj",
    "mlp.fc1",
    "mlp.fc2",
)
TORCH = SwitchBackConfig(backend="torch")


def expected_names(towers=("text_model", "vision_model"), layers=2):
    return {f"{t}.encoder.layers.{i}.{s}" for t in towers for i in range(layers) for s in PER_LAYER}


def swapped(model):
    return {n for n, m in model.named_modules() if isinstance(m, SwitchBackLinear)}


def batch(config, n=4):
    ids = torch.randint(2, config.text_config.vocab_size, (n, 7))
    pixels = torch.randn(n, 3, config.vision_config.image_size, config.vision_config.image_size)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}


def test_defaults_swap_exactly_the_encoder_linears_of_both_towers(clip_config):
    model = apply_switchback(CLIPModel(clip_config), TORCH)
    assert swapped(model) == expected_names()
    assert type(model.visual_projection) is nn.Linear and type(model.text_projection) is nn.Linear


def test_parameters_are_the_same_objects_and_an_existing_optimizer_keeps_working(clip_config):
    model = CLIPModel(clip_config)
    fc1 = model.vision_model.encoder.layers[0].mlp.fc1
    weight, bias = fc1.weight, fc1.bias
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    apply_switchback(model, TORCH)
    new = model.vision_model.encoder.layers[0].mlp.fc1
    assert isinstance(new, SwitchBackLinear) and new.weight is weight and new.bias is bias
    before = weight.detach().clone()
    model(**batch(clip_config), return_loss=True).loss.backward()
    opt.step()
    assert not torch.equal(before, weight)


def test_state_dict_keys_are_unchanged(clip_config):
    model = CLIPModel(clip_config)
    keys = list(model.state_dict())
    apply_switchback(model, TORCH)
    assert list(model.state_dict()) == keys


def test_forward_backward_step_is_finite_and_close_to_unpatched(clip_config):
    plain = CLIPModel(clip_config).eval()
    model = CLIPModel(clip_config).eval()
    model.load_state_dict(plain.state_dict())
    apply_switchback(model, TORCH)
    inputs = batch(clip_config, n=8)
    loss_plain = plain(**inputs, return_loss=True).loss
    out = model(**inputs, return_loss=True)
    assert torch.isfinite(out.loss)
    # 24 int8 layers in series move the contrastive loss by about 1% at most: measured over seeds 0-5 at most 0.65%
    # (transformers 5.24) and 1.32% (5.4, whose random init differs); a broken layer moves it by tens of percent
    assert abs(out.loss.item() - loss_plain.item()) < 0.025 * loss_plain.item()
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_remove_restores_nn_linear_with_identical_weights(clip_config):
    model = CLIPModel(clip_config)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    apply_switchback(model, TORCH)
    remove_switchback(model)
    assert not swapped(model)
    assert all(type(m) is nn.Linear for n, m in model.named_modules() if n in expected_names())
    for k, v in model.state_dict().items():
        assert torch.equal(v, reference[k]), k


def test_applying_twice_does_not_double_wrap_and_updates_the_config(clip_config):
    model = apply_switchback(CLIPModel(clip_config), TORCH)
    row = SwitchBackConfig(weight_scaling="row", backend="torch")
    apply_switchback(model, row)
    assert swapped(model) == expected_names()
    for name in expected_names():
        module = model.get_submodule(name)
        assert type(module) is SwitchBackLinear and module.switchback_config is row
        assert not any(isinstance(c, SwitchBackLinear) for c in module.children())


def test_applying_again_with_a_narrower_selection_refuses_and_changes_nothing(clip_config):
    model = apply_switchback(CLIPModel(clip_config), TORCH)
    mlp_only = SwitchBackConfig(target_modules=["fc1", "fc2"], weight_scaling="row", backend="torch")
    with pytest.raises(ValueError, match=r"16 layers already use SwitchBack.*self_attn.*remove_switchback"):
        apply_switchback(model, mlp_only)
    with pytest.raises(ValueError, match="already use SwitchBack"):
        apply_switchback(model, TORCH, filter_fn=lambda name, m: "vision" in name)
    assert swapped(model) == expected_names()
    assert all(m.switchback_config is TORCH for m in model.modules() if isinstance(m, SwitchBackLinear))
    # the documented way to narrow: remove first
    apply_switchback(remove_switchback(model), mlp_only)
    assert swapped(model) == {n for n in expected_names() if n.endswith(("fc1", "fc2"))}


def test_applying_again_with_a_wider_selection_reconfigures_every_layer(clip_config):
    model = apply_switchback(
        CLIPModel(clip_config), SwitchBackConfig(target_modules=["fc1"], backend="torch")
    )
    row = SwitchBackConfig(weight_scaling="row", backend="torch")
    apply_switchback(model, row)
    assert swapped(model) == expected_names()
    assert all(m.switchback_config is row for m in model.modules() if isinstance(m, SwitchBackLinear))


def test_save_pretrained_loads_into_plain_clip_with_identical_tensors(clip_config, tmp_path):
    model = apply_switchback(CLIPModel(clip_config), TORCH)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    plain = CLIPModel.from_pretrained(tmp_path)
    assert not swapped(plain)
    loaded, original = plain.state_dict(), model.state_dict()
    assert loaded.keys() == original.keys()
    for k in original:
        assert torch.equal(loaded[k], original[k]), k


@pytest.mark.parametrize("cls,tower", [(CLIPVisionModel, "vision_model"), (CLIPTextModel, "text_model")])
def test_single_towers(cls, tower):
    config = getattr(tiny_clip_config(), f"{tower.split('_')[0]}_config")
    model = apply_switchback(cls(config), TORCH)
    # transformers 5 dropped the tower prefix on the single-tower models; older versions keep it
    names = {n.removeprefix(tower + ".") for n in swapped(model)}
    assert names == {n.removeprefix(tower + ".") for n in expected_names(towers=(tower,))}


def test_regex_and_suffix_targets_and_excludes(clip_config):
    model = apply_switchback(
        CLIPModel(clip_config), SwitchBackConfig(target_modules=r".*mlp\.fc\d", backend="torch")
    )
    assert swapped(model) == {n for n in expected_names() if ".mlp." in n}

    cfg = SwitchBackConfig(
        target_modules=["fc1", "vision_model.encoder.layers.1.self_attn.q_proj"], backend="torch"
    )
    model = apply_switchback(CLIPModel(clip_config), cfg)
    want = {n for n in expected_names() if n.endswith("fc1")} | {
        "vision_model.encoder.layers.1.self_attn.q_proj"
    }
    assert swapped(model) == want

    cfg = SwitchBackConfig(exclude_modules=r"text_model\..*", backend="torch")
    model = apply_switchback(CLIPModel(clip_config), cfg)
    assert swapped(model) == expected_names(towers=("vision_model",))

    # a suffix matches whole dotted components only: "proj" is not a suffix of "q_proj"
    with pytest.raises(ValueError):
        apply_switchback(CLIPModel(clip_config), SwitchBackConfig(target_modules=["proj"], backend="torch"))


def test_filter_fn_narrows_the_selection(clip_config):
    model = apply_switchback(CLIPModel(clip_config), TORCH, filter_fn=lambda name, m: m.out_features >= 64)
    assert swapped(model) == {n for n in expected_names() if n.endswith("fc1")}


def test_nothing_matched_lists_the_linears_seen_and_leaves_model_untouched(clip_config):
    model = CLIPModel(clip_config)
    with pytest.raises(ValueError) as err:
        apply_switchback(model, SwitchBackConfig(target_modules=["does_not_exist"]))
    assert "text_model.encoder.layers.0.self_attn" in str(err.value) and "target_modules" in str(err.value)
    assert not swapped(model)


def test_works_on_any_module_with_custom_targets():
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with pytest.raises(ValueError, match="0, 2"):
        apply_switchback(net)  # no CLIP names here: the error shows what there is
    apply_switchback(net, SwitchBackConfig(target_modules=["0", "2"], exclude_modules=None, backend="torch"))
    assert isinstance(net[0], SwitchBackLinear) and isinstance(net[2], SwitchBackLinear)
    assert net(torch.randn(3, 8)).shape == (3, 4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where CUDA is absent")
def test_triton_backend_without_cuda_fails_at_apply_time_and_model_is_untouched(clip_config):
    model = CLIPModel(clip_config)
    with pytest.raises(RuntimeError, match=r"backend=.triton.* CUDA is not available"):
        apply_switchback(model, SwitchBackConfig(backend="triton"))
    assert not swapped(model)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_auto_backend_falls_back_to_torch_and_logs_once(clip_config, caplog):
    backends._warn_fallback_once.cache_clear()
    model = apply_switchback(CLIPModel(clip_config))  # backend="auto"
    with caplog.at_level(logging.INFO, logger="hf_switchback.kernels.backends"):
        model(**batch(clip_config), return_loss=True).loss.backward()
        model(**batch(clip_config), return_loss=True)
    fallback = [r for r in caplog.records if "torch reference kernels" in r.getMessage()]
    assert len(fallback) == 1


def test_bad_config_type_is_rejected(clip_config):
    with pytest.raises(TypeError, match="SwitchBackConfig"):
        apply_switchback(CLIPModel(clip_config), {"precision": "int8"})


def test_importing_the_package_does_not_import_triton():
    import subprocess
    import sys

    code = "import sys, hf_switchback, hf_switchback.training; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_apply_time_loads_the_triton_kernels_only_where_they_can_run():
    """check_backend (apply_switchback, from_pretrained) loads the Triton kernel sets where they can run, so that
    their import is not left to the first compiled step; a machine without CUDA never imports triton."""
    import subprocess
    import sys

    loaded = "print([m in sys.modules for m in ('triton', 'hf_switchback.kernels.ops', 'hf_switchback.kernels.compiled')])"
    cpu = (
        "import sys; from hf_switchback.kernels.backends import check_backend; check_backend('auto'); "
        + loaded
    )
    out = subprocess.run([sys.executable, "-c", cpu], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[False, False, False]"
    # where the Triton kernels can run (stood in for by the check's answer): loaded at apply time, not for 'torch'
    can_run = "import sys; from hf_switchback.kernels import backends; backends.triton_unavailable_reason = lambda: None; "
    for backend, expected in (("torch", "False"), ("auto", "True"), ("triton", "True")):
        code = (
            can_run
            + f"backends.check_backend({backend!r}); print('hf_switchback.kernels.compiled' in sys.modules)"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == expected, (backend, out.stderr[-500:])


def test_multihead_attention_out_proj_is_never_a_target():
    # nn.MultiheadAttention uses out_proj.weight directly, a swap there would silently stay 16-bit
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2)
            self.fc1 = nn.Linear(16, 32)

    block = apply_switchback(Block(), TORCH)
    assert swapped(block) == {"fc1"}


def test_a_bare_linear_is_pointed_to_from_linear():
    with pytest.raises(TypeError, match="from_linear"):
        apply_switchback(nn.Linear(4, 4), SwitchBackConfig(target_modules=".*", backend="torch"))


def test_non_config_objects_are_a_type_error():
    from hf_switchback import switchback_linear

    with pytest.raises(TypeError, match="SwitchBackConfig"):
        switchback_linear(torch.randn(2, 4), torch.randn(3, 4), None, {"weight_scaling": "row"})
    with pytest.raises(TypeError, match="SwitchBackConfig"):
        SwitchBackLinear.from_linear(nn.Linear(4, 3), {"weight_scaling": "row"})


def test_reapplying_with_another_config_drops_the_inference_cache(clip_config):
    from hf_switchback import prepare_for_inference

    model = apply_switchback(CLIPModel(clip_config), TORCH).eval()
    prepare_for_inference(model)
    apply_switchback(model, SwitchBackConfig(precision="fp8", backend="torch"))
    with torch.no_grad():
        out = model(**batch(clip_config))
    assert torch.isfinite(out.logits_per_image).all()
