"""Generation with a prepared Hugging Face model: ``generate`` calls parts of the model
outside its own forward."""

from __future__ import annotations

import copy

import pytest
import torch

import mixprec as mp

transformers = pytest.importorskip("transformers")


def _tiny_t5() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.T5Config(
        d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=100,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config)
    model.generation_config.eos_token_id = None  # ten new tokens each time
    return model.eval()


@pytest.mark.parametrize(
    ("policy", "level"),
    [("mixed_bfloat16", "O2"), ("mixed_float16", "O2"), ("mixed_bfloat16", "O1")],
)
def test_an_encoder_decoders_generate_runs_its_encoder_in_the_policy(policy, level):
    """generate() calls model.get_encoder()(...) outside the model's forward: at O2 its
    16-bit weights met float32 activations ("expected m1 and m2 to have the same dtype"),
    and at O1 it computed in float32, unsaid."""
    control = _tiny_t5()
    ids = torch.randint(2, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    expected = control.generate(input_ids=ids, max_new_tokens=10, do_sample=False)
    model = mp.auto_mixed_precision(copy.deepcopy(control), policy, level).eval()
    computed: list[torch.dtype] = []
    query = model.get_encoder().block[0].layer[0].SelfAttention.q
    query.register_forward_hook(lambda m, args, out: computed.append(out.dtype))
    tokens = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False)
    assert computed == [mp.Policy(policy).compute_dtype]  # the encoder runs once, in 16 bits
    # Greedy tokens as in float32 but where 16-bit rounding flips a near tie (none here on
    # an AMX CPU; 80% allows for another CPU's kernels).
    assert tokens.shape == expected.shape and (tokens == expected).float().mean() >= 0.8
