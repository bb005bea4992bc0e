from __future__ import annotations

import dataclasses

import pytest
import torch

import mixprec as mp
from mixprec import _dtypes, _hardware
from mixprec.policy import PRESETS

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.mark.parametrize(
    ("name", "dtypes", "scaling"),
    [
        ("float32", (F32, F32, F32), "none"),
        ("float16", (F16, F16, F16), "dynamic"),
        ("bfloat16", (BF16, BF16, BF16), "none"),
        ("mixed_float16", (F32, F16, F32), "dynamic"),
        ("mixed_bfloat16", (F32, BF16, F32), "none"),
    ],
)
def test_presets(name, dtypes, scaling):
    p = mp.Policy(name)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == dtypes
    assert p.loss_scaling == scaling
    assert p.name == name
    assert p.variable_dtype == p.param_dtype  # Keras' name
    assert mp.Policy(str(p)) == p


def test_string_grammar_round_trips():
    text = "params=float32,compute=bfloat16,output=float32"
    p = mp.Policy(text)
    assert str(p) == text
    assert p == mp.Policy("mixed_bfloat16")
    odd = mp.Policy("p=fp32, c=fp16, o=half")
    assert (odd.param_dtype, odd.compute_dtype, odd.output_dtype) == (torch.float32, F16, F16)
    assert mp.Policy(str(odd)) == odd
    assert odd.name == str(odd)  # no preset matches


def test_grammar_defaults_follow_params():
    assert mp.Policy("compute=bfloat16") == mp.Policy("mixed_bfloat16")
    assert mp.Policy("params=bfloat16") == mp.Policy("bfloat16")


def test_keyword_construction_and_immutability():
    p = mp.Policy(param_dtype="float32", compute_dtype=torch.float16)
    assert p == mp.Policy("params=float32,compute=float16,output=float32")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.compute_dtype = F32  # type: ignore[misc]
    assert hash(p) == hash(mp.Policy(str(p)))


def test_unknown_name_lists_valid_and_closest():
    with pytest.raises(ValueError, match=r"'mixed_bfloat' is not a known policy") as err:
        mp.Policy("mixed_bfloat")
    message = str(err.value)
    for name in (*PRESETS, "auto"):
        assert name in message
    assert "closest: 'mixed_bfloat16'" in message


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("params=float32,compute=float64", r"'float64' is not a known dtype; valid: float32"),
        ("params=float32,weights=float16", r"bad entry 'weights=float16'"),
        ("compute=float16,compute=bfloat16", r"'compute' is given twice"),
    ],
)
def test_bad_grammar(text, match):
    with pytest.raises(ValueError, match=match):
        mp.Policy(text)


def test_bad_types():
    with pytest.raises(TypeError, match="policy must be a str or Policy, got int"):
        mp.Policy(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="either a name or dtype keywords"):
        mp.Policy("float32", compute_dtype="float16")
    with pytest.raises(ValueError, match=r"compute_dtype=torch.float64 is not supported"):
        mp.Policy(compute_dtype=torch.float64)


def test_global_policy_and_scope():
    assert mp.global_policy() == mp.Policy("float32")
    mp.set_global_policy("mixed_bfloat16")
    assert mp.global_policy().name == "mixed_bfloat16"
    with mp.policy_scope("mixed_float16") as p:
        assert p.name == "mixed_float16"
        assert mp.global_policy() is p
        assert mp.get_policy(None) is p
    assert mp.global_policy().name == "mixed_bfloat16"
    with pytest.raises(RuntimeError), mp.policy_scope("float16"):
        raise RuntimeError("boom")
    assert mp.global_policy().name == "mixed_bfloat16"  # restored after an exception
    mp.set_global_policy(None)
    assert mp.global_policy().name == "float32"


def test_a_scope_is_its_threads_own_and_scopes_may_end_in_any_order():
    """Two threads' scopes saw each other's policy, and A's scope ending before B's left
    A's policy as the process-wide one for good."""
    import threading

    mp.set_global_policy("float32")
    entered, a_exited, b_done = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, str] = {}

    def thread_b() -> None:
        entered.wait()
        with mp.policy_scope("mixed_float16"):
            a_exited.wait()
            seen["b_inside"] = mp.global_policy().name
        seen["b_after"] = mp.global_policy().name
        b_done.set()

    worker = threading.Thread(target=thread_b)
    worker.start()
    with mp.policy_scope("mixed_bfloat16"):
        seen["a_inside"] = mp.global_policy().name
        entered.set()
    a_exited.set()
    b_done.wait(10)
    worker.join(10)
    assert seen == {"a_inside": "mixed_bfloat16", "b_inside": "mixed_float16",
                    "b_after": "float32"}  # fmt: skip
    assert mp.global_policy().name == "float32"
    with mp.policy_scope("mixed_bfloat16"):
        mp.set_global_policy("mixed_float16")  # inside a scope: that scope's, undone with it
        assert mp.global_policy().name == "mixed_float16"
    assert mp.global_policy().name == "float32"


@pytest.mark.parametrize(
    ("hw", "expected"),
    [
        (_hardware.Hardware("cuda", True, True, "CUDA H200 (sm_90)"), "mixed_bfloat16"),
        (_hardware.Hardware("cuda", False, True, "CUDA T4 (sm_75)"), "mixed_float16"),
        (_hardware.Hardware("cpu", True, False, "CPU with amx_bf16"), "mixed_bfloat16"),
        (_hardware.Hardware("cpu", False, False, "CPU without AVX512-BF16 or AMX"), "float32"),
    ],
)
def test_auto_follows_hardware_and_records_reason(monkeypatch, hw, expected):
    monkeypatch.setattr("mixprec.policy.probe_hardware", lambda: hw)
    p = mp.Policy("auto")
    assert p.name == expected
    assert p.reason is not None and hw.detail in p.reason
    assert "reason=" in repr(p)


def test_auto_on_this_machine_matches_cpu_flags():
    hw = _hardware.probe_hardware()
    p = mp.Policy("auto")
    if hw.device == "cpu":
        flags = _hardware._cpu_flags()
        has_bf16 = bool(flags & {"amx_bf16", "amx_tile"}) or (
            "avx512_bf16" in flags and _hardware.bf16_matmul_speedup() >= _hardware.BF16_WORTH
        )
        if flags:
            assert (p.name == "mixed_bfloat16") == has_bf16


def test_parse_dtype_aliases():
    assert _dtypes.parse_dtype("bf16") is BF16
    assert _dtypes.parse_dtype("torch.float16") is F16
    assert _dtypes.parse_dtype(F32) is F32
    with pytest.raises(ValueError, match=r"dtype='int8' is not a known dtype"):
        _dtypes.parse_dtype("int8")


@pytest.mark.parametrize("value", [0, False, [], {}, 0.0])
def test_falsy_dtypes_are_refused_not_read_as_float32(value):
    """Issue 15 item 7: these meant float32 while param_dtype=1 raised."""
    for keyword in ("param_dtype", "compute_dtype", "output_dtype"):
        with pytest.raises(TypeError, match=rf"{keyword} must be a str or torch.dtype, got "):
            mp.Policy(**{keyword: value})
    with pytest.raises(ValueError, match=r"param_dtype='' is not a known dtype"):
        mp.Policy(param_dtype="")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("params=bfloat16,compute=float16", "16-bit weights compute in their own dtype"),
        ("params=float16,compute=float32,output=float16", "16-bit weights compute in their own"),
        ("params=float32,compute=float32,output=bfloat16", "float32 math returns float32"),
    ],
)
def test_combinations_auto_mixed_precision_cannot_honour_are_refused(text, message):
    """They were accepted, and auto_mixed_precision then ignored part of them silently."""
    with pytest.raises(ValueError, match=f"policy params=.*: {message}"):
        mp.Policy(text)
    values = [part.split("=")[1] for part in text.split(",")]
    keywords = dict(zip(("param_dtype", "compute_dtype", "output_dtype"), values, strict=False))
    with pytest.raises(ValueError, match=message):
        mp.Policy(**keywords)


def test_a_policy_of_a_policy_and_auto_in_capitals():
    policy = mp.Policy("mixed_float16")
    assert mp.Policy(policy) == policy
    model = mp.auto_mixed_precision(torch.nn.Linear(2, 2), "AUTO")
    assert mp.levels.applied(model).policy == mp.Policy("auto")


def test_a_scope_in_a_generator_closed_from_another_thread_ends():
    """The scope's end runs in another context than its start there: it raised (a
    contextvars token is bound to its context) and left the scope in force for good."""
    import threading

    mp.set_global_policy("float32")

    def batches():
        with mp.policy_scope("mixed_bfloat16"):
            yield mp.global_policy().name
            yield mp.global_policy().name

    gen = batches()
    assert next(gen) == "mixed_bfloat16"
    errors: list[BaseException] = []

    def close() -> None:
        try:
            gen.close()
        except BaseException as err:  # recorded for the assertion
            errors.append(err)

    worker = threading.Thread(target=close)
    worker.start()
    worker.join(10)
    assert errors == [] and mp.global_policy().name == "float32"
    with mp.policy_scope("mixed_float16"):
        with mp.policy_scope(None):
            assert mp.global_policy().name == "float32"
        assert mp.global_policy().name == "mixed_float16"


def test_set_global_policy_in_a_task_or_worker_thread_leaves_the_callers_scope():
    """Tasks and asyncio.to_thread copy the context, and so held the caller's scope
    object: a worker's set_global_policy("float32") rewrote it, and the caller's next
    auto_mixed_precision(model) prepared it in float32, O0, unsaid."""
    import asyncio

    mp.set_global_policy("float32")
    seen: dict[str, str] = {}

    def worker() -> None:
        mp.set_global_policy("float32")
        seen["worker"] = mp.global_policy().name

    async def sibling() -> None:
        mp.set_global_policy("mixed_bfloat16")
        seen["sibling"] = mp.global_policy().name

    async def main() -> None:
        with mp.policy_scope("mixed_float16"):
            await asyncio.to_thread(worker)
            await asyncio.create_task(sibling())
            seen["caller"] = mp.global_policy().name
            model = mp.auto_mixed_precision(torch.nn.Linear(2, 2))
            seen["prepared"] = mp.levels.applied(model).policy.name
            mp.set_global_policy("mixed_bfloat16")  # the caller's own: its scope's, as before
            seen["own"] = mp.global_policy().name
        seen["after"] = mp.global_policy().name

    asyncio.run(main())
    assert seen == {
        "worker": "float32",
        "sibling": "mixed_bfloat16",
        "caller": "mixed_float16",
        "prepared": "mixed_float16",
        "own": "mixed_bfloat16",
        "after": "float32",  # the scope's setting ended with it
    }


@pytest.mark.parametrize(("speedup", "fast"), [(0.52, False), (4.5, True)])
def test_avx512_bf16_without_amx_takes_bfloat16_only_where_it_measured_faster(
    monkeypatch, speedup, fast
):
    """An Intel Xeon with AVX512-BF16 and no AMX ran bfloat16 matmuls at 0.52x float32's
    speed, and auto took bfloat16 by the flag: the main job and every auto model trained
    at 0.57-0.67x float32's speed. AMD's EPYC measured 4.3-4.7x. AMX is not measured."""
    monkeypatch.setattr(_hardware, "_cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    monkeypatch.setattr(_hardware, "bf16_matmul_speedup", lambda: speedup)
    monkeypatch.setattr("mixprec.policy.probe_hardware", _hardware.probe_cpu)
    cpu = _hardware.probe_cpu()
    assert cpu.bf16_fast is fast and _hardware.cpu_fast("bfloat16") is fast
    assert mp.Policy("auto").name == ("mixed_bfloat16" if fast else "float32")
    if not fast:
        assert "bfloat16 matmuls measured 0.52x float32's speed" in cpu.detail
    monkeypatch.setattr(_hardware, "_cpu_flags", lambda: frozenset({"amx_bf16", "amx_tile"}))
    assert _hardware.probe_cpu().bf16_fast  # AMX: by the flag


def test_the_bf16_matmul_measurement_leaves_torchs_generator_as_it_was():
    _hardware.bf16_matmul_speedup.cache_clear()
    state = torch.get_rng_state()
    assert _hardware.bf16_matmul_speedup() > 0
    assert torch.equal(state, torch.get_rng_state())
