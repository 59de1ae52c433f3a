"""bf16 models without autocast (a bf16 model, peft's LoRA on a bf16 base): Sigma is formed from the bf16
activations with float32 accumulation where the device's GEMM has it, with the value of the float32 sums.

The CPU has no half-precision GEMM with a float32 output; the tests let it stand for one (CUDA's) by adding
it to statistics.LOW_PRECISION_GRAM_DEVICES and run that GEMM as CUDA does: float32 sums of the exact
products of the inputs. The feature-space solve (``solve_space="features"``): these small batches have fewer
rows than d, where the default ("auto") keeps the rows and forms no d x d Sigma at all (dopr/sample_space.py)."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import dopr
from dopr import statistics
from dopr.layers.lora import LoraInputHelper

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


class _HalfGemmOnCpu(TorchDispatchMode):
    """mm / bmm with ``out_dtype`` (half in, float32 out) as CUDA computes it: the exact products, summed in
    float32; ``calls`` has the input and output dtypes and the width of each."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm) and (len(args) > 2 or "out_dtype" in kwargs):
            self.calls.append((args[0].dtype, args[1].dtype, args[2] if len(args) > 2 else kwargs["out_dtype"],
                               args[1].shape[-1]))
            return func.overloadpacket(args[0].float(), args[1].float())
        return func(*args, **kwargs)


@pytest.fixture
def grams(monkeypatch):
    """With the CPU standing for CUDA: ``inputs``, the activations that reach the covariance GEMM
    (statistics.gram), and ``gemm``, the half-precision GEMMs run (_HalfGemmOnCpu.calls)."""
    monkeypatch.setattr(statistics, "LOW_PRECISION_GRAM_DEVICES", {"cpu"})
    seen, real = [], statistics.gram
    monkeypatch.setattr(statistics, "gram", lambda z, *a, **k: seen.append(z) or real(z, *a, **k))
    with _HalfGemmOnCpu() as mode:
        yield SimpleNamespace(inputs=seen, gemm=mode.calls)


def _llama(dropout: float, r: int = 4):
    """Two decoder layers of width 64 (MLP 128), bf16, peft LoRA on all seven projections as the 8B SFT has."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256)
    model = transformers.LlamaForCausalLM(config).bfloat16()
    lora = peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=dropout, bias="none", task_type="CAUSAL_LM",
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return peft.get_peft_model(model, lora)


def _train_step(model, opt):
    ids = torch.randint(256, (2, 24), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


@pytest.mark.parametrize("dropout", [0.05, 0.0])
def test_peft_lora_on_a_bf16_base_feeds_the_covariance_gemm_bf16(grams, dropout):
    # peft keeps the adapters in float32 and casts the bf16 input up before lora_A (through its dropout):
    # lora_A's Sigma is formed from the bf16 values, lora_B's input (lora_A's float32 output) stays float32
    model = _llama(dropout)
    opt = dopr.build(model, "adamw", ap={"solve_space": "features"}, lr=1e-3)
    assert next(m for n, m in model.named_modules() if n.endswith("lora_A.default")).weight.dtype == torch.float32
    _train_step(model, opt)
    by_dim = {}
    for z in grams.inputs:
        by_dim.setdefault(z.shape[1], []).append(z.dtype)
    # per decoder layer: q, k, v, o, gate, up read width 64 and down 128; every lora_B reads r = 4
    assert by_dim == {64: [torch.bfloat16] * 12, 128: [torch.bfloat16] * 2, 4: [torch.float32] * 14}
    # and the GEMM itself takes them as bf16, accumulating in float32
    bf16 = (torch.bfloat16, torch.bfloat16, torch.float32)
    assert sorted(grams.gemm, key=lambda c: c[3]) == [(*bf16, 64)] * 12 + [(*bf16, 128)] * 2
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_bf16_model_without_autocast_feeds_the_covariance_gemm_bf16(grams):
    # a bf16 model's layers read bf16 activations: Sigma takes them as they are, the homogeneous 1 included
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).bfloat16()
    opt = dopr.build(model, "adamw", ap={"solve_space": "features"}, lr=1e-3)
    model(torch.randn(40, 16).bfloat16()).float().square().mean().backward()
    opt.step()
    # the gram is of [z, 1] (the homogeneous column appended in the activations' dtype: 1 is exact in bf16)
    assert [(z.dtype, z.shape[1]) for z in grams.inputs] == [(torch.bfloat16, 17), (torch.bfloat16, 33)]
    assert grams.gemm == [(torch.bfloat16, torch.bfloat16, torch.float32, d) for d in (17, 33)]


def test_a_lora_model_cast_to_float32_goes_back_to_float32_sigma(grams):
    # the check runs at every capture: once the base is float32 the input is no upcast of bf16 values
    model = _llama(0.05)
    opt = dopr.build(model, "adamw", ap={"solve_space": "features"}, lr=1e-3)
    model.float()
    _train_step(model, opt)
    assert grams.inputs and all(z.dtype == torch.float32 for z in grams.inputs) and grams.gemm == []


@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_lora_sigma_is_the_float64_covariance_of_what_lora_a_multiplies(grams, monkeypatch, dropout):
    # b = z / c rounded to bf16 is exactly the layer's bf16 input times the dropout mask, and
    # Sigma = c^2 b^T b equals the float64 z^T z of lora_A's float32 input z up to float32 accumulation
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(48, 32)).bfloat16()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["0"]))
    layer = model.base_model.model[0]
    formed, inputs = [], {}
    layer.register_forward_pre_hook(lambda m, args: inputs.setdefault("x", args[0]))
    layer.lora_A["default"].register_forward_pre_hook(lambda m, args: inputs.setdefault("z", args[0]))
    real = LoraInputHelper.statistics

    def spy(self, x, kind):
        stat = real(self, x, kind)
        formed.append(stat.sums[0].clone())   # as formed (the step turns the sums into the mean in place)
        return stat

    monkeypatch.setattr(LoraInputHelper, "statistics", spy)
    opt = dopr.build(model, "sgd", ap={"solve_space": "features"}, lr=0.0)
    model(torch.randn(300, 48).bfloat16()).float().sum().backward()
    opt.step()
    x, z = inputs["x"], inputs["z"]
    assert x.dtype == torch.bfloat16 and z.dtype == torch.float32 and len(formed) == 1
    b = grams.inputs[0]
    assert b.dtype == torch.bfloat16 and torch.equal(b, x * (z != 0))
    c = 1 / (1 - dropout)
    torch.testing.assert_close(z, b.float() * c, rtol=2**-23, atol=0)   # z holds c times the bf16 values
    z64 = z.double()
    want = z64.T @ z64
    # float32 sums of n exact products (at most min(n, GRAM_CHUNK_ROWS) + n / GRAM_CHUNK_ROWS units of roundoff of
    # the sums of |z_i z_j|), plus the scaling by c^2 and z's own rounding of c b: a few units more. (b rounded
    # from z itself, not z / c, would be 2^-9 off per entry: outside it.)
    n = z.shape[0]
    units = min(n, statistics.GRAM_CHUNK_ROWS) + n / statistics.GRAM_CHUNK_ROWS + 4
    bound = units * 2**-24 * (z64.abs().T @ z64.abs())
    s = formed[0]
    assert s.dtype == torch.float32 and ((s.double() - want).abs() <= bound).all()
