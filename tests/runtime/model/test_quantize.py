import pytest
import torch
from pydantic import ValidationError
from torch import nn
from transformers import AutoModelForCausalLM

from runtime.kv.kv_split import model_cost
from runtime.model.quantize import INT4_GROUP_SIZE, QuantizedLinear, QuantizeError, linear_layers, quantize_model
from server.config import Settings
from tests.runtime.engine_helpers import engine_for, hf_greedy, request, run

MODES = ["int8", "int4"]
PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [1, 20, 21], [1, 40]]
# Largest logit error allowed, as a fraction of the float model's logit range on the same input.
LOGIT_TOLERANCE = {"int8": 0.02, "int4": 0.12}


@pytest.fixture(params=["tiny_llama", "tiny_qwen2"])
def model_dir(request):
    return request.getfixturevalue(request.param)


def load(model_dir, mode="none"):
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    quantize_model(model, mode)
    return model


@pytest.mark.parametrize("mode", MODES)
def test_every_linear_layer_is_replaced(model_dir, mode):
    model = load(model_dir)
    names = [name for name, *_ in linear_layers(model)]
    assert "lm_head" in names and len(names) == 7 * model.config.num_hidden_layers + 1
    assert quantize_model(model, mode) == len(names)
    assert linear_layers(model) == []
    modules = dict(model.named_modules())
    assert all(isinstance(modules[name], QuantizedLinear) for name in names)


@pytest.mark.parametrize("mode", MODES)
def test_quantized_logits_are_close_to_float(model_dir, mode):
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        reference = load(model_dir)(ids).logits
        quantized = load(model_dir, mode)(ids).logits
    error = (quantized - reference).abs().max().item()
    assert 0 < error <= LOGIT_TOLERANCE[mode] * (reference.max() - reference.min()).item()


@pytest.mark.parametrize("mode", MODES)
def test_quantized_engine_matches_generate_on_the_same_quantized_model(model_dir, mode):
    engine = engine_for(model_dir, quantize=mode)
    assert not any(isinstance(m, nn.Linear) for m in engine.model.modules())
    assert engine.vocab_size == engine.model.config.vocab_size
    reference = load(model_dir, mode)
    results = run(engine, [request(str(i), p, max_tokens=10) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        assert results[str(i)]["choices"][0] == hf_greedy(reference, prompt, 10)


def test_a_row_gets_the_same_bits_whatever_the_other_rows():
    torch.manual_seed(0)
    linear = nn.Linear(2 * INT4_GROUP_SIZE, 96)
    x = torch.randn(40, linear.in_features) * torch.linspace(0.1, 10, 40)[:, None]
    for mode in MODES:
        module = nn.Sequential(linear)
        quantize_model(module, mode)
        full = module(x)
        assert all(torch.equal(module(x[:rows]), full[:rows]) for rows in range(1, 40)), mode
        assert all(torch.equal(module(x[i:i + 1]), full[i:i + 1]) for i in range(40)), mode


def test_an_unknown_mode_stops_start_up_naming_the_setting(tiny_llama):
    with pytest.raises(QuantizeError, match=r"^model\.quantize = 'int3' is not one of auto, none, int8, int4$"):
        engine_for(tiny_llama, quantize="int3")
    with pytest.raises(ValidationError, match="quantize"):
        Settings.load(model={"quantize": "int3"})


def test_int4_needs_in_features_divisible_by_the_group_size():
    model = nn.Sequential(nn.Linear(INT4_GROUP_SIZE, 8), nn.Linear(8, 3 * INT4_GROUP_SIZE // 2))
    with pytest.raises(QuantizeError, match=r"^model\.quantize = 'int4' needs in_features divisible by the "
                                            rf"group size {INT4_GROUP_SIZE}, and 1 has 8$"):
        quantize_model(model, "int4")
    assert all(isinstance(m, nn.Linear) for m in model)  # checked before anything changed
    assert quantize_model(model, "int8") == 2


def test_a_device_or_dtype_the_kernels_cannot_take_stops_start_up():
    with pytest.raises(QuantizeError, match=r"^model\.quantize = 'int8' runs on the CPU only, and 0 is on meta"):
        quantize_model(nn.Sequential(nn.Linear(64, 64, device="meta")), "int8")
    with pytest.raises(QuantizeError, match=r"^model\.quantize = 'int4' cannot take 0: its weights are float64$"):
        quantize_model(nn.Sequential(nn.Linear(64, 64, dtype=torch.float64)), "int4")


def test_int4_where_its_kernel_cannot_run_stops_start_up(monkeypatch):
    monkeypatch.setattr("runtime.kernels.cpu_kernels._load",
                        lambda: "it needs AVX2, and torch reports this CPU's vector unit as DEFAULT")
    model = nn.Sequential(nn.Linear(64, 64))
    with pytest.raises(QuantizeError, match=r"^model\.quantize = 'int4' needs ponder's int4 CPU kernel, which cannot "
                                            r"run here: it needs AVX2, and torch reports this CPU's vector unit as "
                                            r"DEFAULT; set model\.quantize = \"none\"$"):
        quantize_model(model, "int4")
    assert isinstance(model[0], nn.Linear)


def test_the_setting_reaches_the_runtime_options(monkeypatch):
    assert Settings.load().runtime_options().quantize == "auto"
    monkeypatch.setenv("PONDER_MODEL__QUANTIZE", "int4")
    assert Settings.load().runtime_options().quantize == "int4"
    assert Settings.load(model={"quantize": "int8"}).runtime_options().quantize == "int8"


@pytest.mark.parametrize("mode", MODES)
def test_the_roofline_cost_counts_quantized_weights_as_stored(tiny_llama, mode):
    model = load(tiny_llama)
    before = model_cost(model, 4, with_head=True)
    quantize_model(model, mode)
    after = model_cost(model, 4, with_head=True)
    assert after.flops_per_token == before.flops_per_token
    bits = 8 if mode == "int8" else 4
    assert before.weight_bytes * bits / 32 < after.weight_bytes < before.weight_bytes * (bits + 4) / 32


@pytest.mark.parametrize("mode", MODES)
def test_a_layer_computes_with_the_weights_its_codes_stand_for(mode):
    torch.manual_seed(0)
    linear = nn.Linear(2 * INT4_GROUP_SIZE, 24)
    module = nn.Sequential(linear)
    quantize_model(module, mode)
    x = torch.randn(5, linear.in_features)
    expected = x.bfloat16().float() @ module[0].dequantized().T + linear.bias
    assert torch.allclose(module(x), expected, atol=0.02, rtol=0.01)
    error = (module[0].dequantized() - linear.weight).abs().max().item()
    step = linear.weight.abs().max().item() * (1 / 127 if mode == "int8" else 2 / 15)  # one code apart
    assert 0 < error <= step


def test_the_start_up_check_refuses_an_unknown_mode_before_anything_loads():
    from runtime.preflight import check
    from runtime.wire.options import RuntimeOptions

    check(RuntimeOptions(device="cpu", quantize="int4"))
    with pytest.raises(QuantizeError, match=r"^model\.quantize = 'int3' is not one of auto, none, int8, int4$"):
        check(RuntimeOptions(device="cpu", quantize="int3"))


def test_the_start_up_check_refuses_quantization_off_the_cpu(monkeypatch):
    import runtime.preflight as preflight
    from runtime.wire.options import RuntimeOptions

    monkeypatch.setattr(preflight, "pick_device", lambda device: torch.device(device))  # as on a GPU machine
    monkeypatch.setattr(preflight, "pick_dtype", lambda dtype, device: torch.bfloat16)
    preflight.check(RuntimeOptions(device="cuda", quantize="none"))
    preflight.check(RuntimeOptions(device="cuda", quantize="auto"))  # auto keeps float weights there
    with pytest.raises(QuantizeError, match=r"^model\.quantize = 'int8' runs on the CPU only, and model\.device "
                                            r"is cuda; set model\.quantize = \"none\" or model\.device = \"cpu\"$"):
        preflight.check(RuntimeOptions(device="cuda", quantize="int8"))
