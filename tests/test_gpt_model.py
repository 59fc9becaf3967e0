"""The byte-level GPT: sizes, parameter order, loss at init, training, RNG-free generation."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from ripresa import BadInput
from ripresa.engine.gpt import CONFIGS, GPT, TRAIN_DEFAULTS, builtin_source, from_config_dict
from ripresa.engine.gpt.sources import CropSampler

TINY = CONFIGS["tiny"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _tiny(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(TINY)


# ---- sizes -----------------------------------------------------------------------


def test_tiny_is_small_and_analytic_count_matches_real_construction():
    model = _tiny()
    assert model.n_params() == TINY.param_count() == sum(p.numel() for p in model.parameters())
    assert model.n_params() < 200_000
    no_bias = dataclasses.replace(TINY, bias=False)
    assert GPT(no_bias).n_params() == no_bias.param_count()


def test_andrea_12m_has_12_8m_params_within_5_percent():
    torch.manual_seed(0)
    model = GPT(CONFIGS["andrea-12m"])  # real construction: 51 MB, fast
    n = sum(p.numel() for p in model.parameters())
    assert n == model.n_params() == CONFIGS["andrea-12m"].param_count()
    assert abs(n - 12.8e6) / 12.8e6 < 0.05, n
    # the ANDREA .bin of the reference exercise: 8 + 12 n bytes ~ 154 MB
    assert abs((8 + 12 * n) - 154e6) / 154e6 < 0.05


def test_andrea_120m_has_120m_params_within_5_percent_on_meta_device():
    with torch.device("meta"):  # shapes only: no 480 MB allocation
        model = GPT(CONFIGS["andrea-120m"])
    assert all(p.is_meta for p in model.parameters())
    n = sum(p.numel() for p in model.parameters())
    assert n == CONFIGS["andrea-120m"].param_count()
    assert abs(n - 120e6) / 120e6 < 0.05, n


def test_every_config_has_train_defaults():
    assert set(TRAIN_DEFAULTS) == set(CONFIGS)
    for name, d in TRAIN_DEFAULTS.items():
        assert d.batch_size >= 1 and 0 < d.min_lr <= d.lr < 1e-2 and d.betas == (0.9, 0.999), name
        json.dumps(d.to_dict())
    assert TINY.dropout > 0  # training must consume the torch RNG, even in the smoke test


# ---- config ----------------------------------------------------------------------


def test_config_round_trips_through_json():
    for cfg in CONFIGS.values():
        assert from_config_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(n_embd=65),  # not a multiple of n_head=2
        dict(n_layer=0),
        dict(n_layer=True),
        dict(block_size=2.5),
        dict(dropout=1.0),
        dict(dropout=-0.1),
        dict(vocab_size=100),
        dict(bias="yes"),
    ],
)
def test_invalid_configs_are_refused(kwargs):
    with pytest.raises(BadInput):
        dataclasses.replace(TINY, **kwargs)


def test_config_dict_with_unknown_or_missing_keys_is_refused():
    d = TINY.to_dict()
    with pytest.raises(BadInput, match="unknown"):
        from_config_dict({**d, "n_embed": 64})
    d.pop("n_head")
    with pytest.raises(BadInput, match="required"):
        from_config_dict(d)
    with pytest.raises(BadInput):
        from_config_dict([1, 2])  # type: ignore[arg-type]


# ---- parameter order (the .bin order) -----------------------------------------------


@pytest.mark.parametrize("name", ["tiny", "andrea-12m"])
def test_parameter_order_is_embeddings_then_layers_then_head(name):
    with torch.device("meta"):
        model = GPT(CONFIGS[name])
    names = [n for n, _ in model.named_parameters()]
    assert names[:2] == ["transformer.wte.weight", "transformer.wpe.weight"]
    assert names[-3:] == ["transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"]
    layers = [int(n.split(".")[2]) for n in names[2:-3]]
    assert layers == sorted(layers) and set(layers) == set(range(CONFIGS[name].n_layer))
    # within a layer: attention before MLP
    layer0 = [n for n in names if n.startswith("transformer.h.0.")]
    assert max(i for i, n in enumerate(layer0) if ".attn." in n) < min(i for i, n in enumerate(layer0) if ".mlp." in n)
    # untied head: no shared tensor, parameters() and state_dict() list the same tensors
    assert len(names) == len(model.state_dict())
    assert all(p.dtype == torch.float32 for p in model.parameters())


# ---- forward -------------------------------------------------------------------------


def test_forward_shapes_and_loss_at_init_is_ln_256():
    model = _tiny()
    idx = torch.randint(0, 256, (4, TINY.block_size))
    logits, loss = model(idx, idx)
    assert logits.shape == (4, TINY.block_size, 256) and logits.dtype == torch.float32
    assert abs(loss.item() - math.log(256)) < 0.1, loss.item()
    logits2, none = model(idx[:, :10])
    assert none is None and logits2.shape == (4, 10, 256)
    with pytest.raises(BadInput, match="context"):
        model(torch.zeros(1, TINY.block_size + 1, dtype=torch.long))


def test_training_draws_from_torch_rng_and_eval_does_not():
    model = _tiny()
    idx = torch.randint(0, 256, (2, 16))
    before = torch.get_rng_state()
    model.eval()
    a, _ = model(idx)
    b, _ = model(idx)
    assert torch.equal(before, torch.get_rng_state()) and torch.equal(a, b)
    model.train()
    model(idx)
    assert not torch.equal(before, torch.get_rng_state())  # dropout masks were drawn


def test_configure_optimizer_groups_decay_and_no_decay():
    model = _tiny()
    opt = model.configure_optimizer(1e-3, 0.1, (0.9, 0.999), "cpu")
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    assert not decay.get("fused") and decay["betas"] == (0.9, 0.999) and not decay["amsgrad"]


@pytest.mark.slow
def test_tiny_learns_stdlib_code_in_30_adamw_steps():
    model = _tiny()
    d = TRAIN_DEFAULTS["tiny"]
    opt = model.configure_optimizer(d.lr, d.weight_decay, d.betas, "cpu")
    sampler = CropSampler(
        {"stdlib-code": builtin_source("stdlib-code")}, TINY.block_size, d.batch_size, np.random.default_rng(0)
    )
    losses = []
    model.train()
    for _ in range(30):
        x, y, _ = sampler.batch("stdlib-code")
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), d.grad_clip)
        opt.step()
        losses.append(loss.item())
    first, last = np.mean(losses[:3]), np.mean(losses[-3:])
    assert first > 5.0 and last < first - 1.0, losses


# ---- generation ------------------------------------------------------------------------


def test_generate_is_deterministic_given_the_generator_and_leaves_global_rng_and_modes_alone():
    model = _tiny()
    model.train()
    model.transformer.drop.eval()  # a mixed state must come back exactly
    modes = {n: m.training for n, m in model.named_modules()}
    prompt = torch.tensor([list(b"def ")], dtype=torch.long)
    rng_before = torch.get_rng_state()

    out1 = model.generate(prompt, 20, generator=torch.Generator().manual_seed(1))
    out2 = model.generate(prompt, 20, generator=torch.Generator().manual_seed(1))
    out3 = model.generate(prompt, 20, generator=torch.Generator().manual_seed(2))

    assert torch.equal(torch.get_rng_state(), rng_before)
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert out1.shape == (1, 4 + 20) and torch.equal(out1[:, :4], prompt)
    assert torch.equal(out1, out2) and not torch.equal(out1, out3)
    assert all(p.grad is None for p in model.parameters())


def test_generate_top_k_1_is_greedy_and_long_prompts_are_cropped():
    model = _tiny().eval()
    prompt = torch.randint(0, 256, (2, TINY.block_size + 5))  # longer than the context
    g = torch.Generator().manual_seed(0)
    greedy = model.generate(prompt, 5, generator=g, temperature=0.0)
    top1 = model.generate(prompt, 5, generator=g, top_k=1, temperature=0.7)
    assert torch.equal(greedy, top1) and greedy.shape == (2, TINY.block_size + 10)
    assert not model.training
    with pytest.raises(BadInput):
        model.generate(prompt, 1, generator=None)  # type: ignore[arg-type]
    with pytest.raises(BadInput):
        model.generate(prompt, 1, generator=g, temperature=-1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_forward_fused_optimizer_and_cpu_generator_sampling():
    torch.manual_seed(0)
    model = GPT(TINY).cuda()
    opt = model.configure_optimizer(1e-3, 0.1, device_type="cuda")
    assert opt.param_groups[0]["fused"]
    x = torch.randint(0, 256, (2, 32), device="cuda")
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    cuda_rng = torch.cuda.get_rng_state()
    a = model.generate(x[:, :4], 8, generator=torch.Generator().manual_seed(3))
    b = model.generate(x[:, :4], 8, generator=torch.Generator().manual_seed(3))
    assert a.device.type == "cuda" and torch.equal(a, b)
    assert torch.equal(cuda_rng, torch.cuda.get_rng_state())
