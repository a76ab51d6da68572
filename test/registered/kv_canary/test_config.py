"""CanaryConfig / environment variables / start-up refusals (no server needed)."""

from __future__ import annotations

import re
import sys
import types

import pytest

from sglang.jit_kernel.kv_canary.consts import RealKvHashMode
from sglang.jit_kernel.kv_canary.types import PoolKind
from sglang.srt.kv_canary.startup_checks import check_server_args_for_canary
from sglang.srt.kv_canary.config import CanaryConfig, CanaryMode
from sglang.srt.kv_canary.envs import MAX_RING_CAPACITY, MAX_STEP_INTERVAL, CanaryEnvs
from sglang.srt.kv_canary.perturb.config import FaultKind, PerturbConfig
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=1, suite="stage-a-test-cpu")


def _args(**kw):
    base = dict(
        kv_canary="raise",
        kv_canary_sweep_interval=0,
        kv_canary_real_data="none",
        device="cpu",
        disable_piecewise_cuda_graph=True,
        enable_torch_compile=False,
    )
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_defaults_and_parsing(monkeypatch):
    for name in vars(CanaryEnvs):
        if name.startswith("SGLANG_"):
            monkeypatch.delenv(name, raising=False)
    cfg = CanaryConfig.from_server_args(_args(kv_canary="LOG", kv_canary_real_data="partial"))
    assert cfg.mode == CanaryMode.LOG and cfg.real_kv_hash_mode == RealKvHashMode.PARTIAL
    assert (cfg.ring_capacity, cfg.stats_print_every_n_steps, cfg.sweep_interval) == (1024, 100, 0)
    assert not (cfg.enable_write_input_assert or cfg.enable_verify_token_assert or cfg.enable_mha_v)
    assert not CanaryConfig.from_server_args(types.SimpleNamespace()).enabled  # no canary args


def test_environment_is_parsed_once_into_the_config(monkeypatch):
    monkeypatch.setenv("SGLANG_KV_CANARY_RING_CAPACITY", "16")
    monkeypatch.setenv("SGLANG_KV_CANARY_ENABLE_MHA_V", "true")
    monkeypatch.setenv("SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS", "0")
    cfg = CanaryConfig.from_server_args(_args())
    assert cfg.ring_capacity == 16 and cfg.enable_mha_v and cfg.stats_print_every_n_steps == 0
    monkeypatch.setenv("SGLANG_KV_CANARY_RING_CAPACITY", "999")
    assert cfg.ring_capacity == 16  # frozen: nothing re-reads the environment


def test_the_config_is_built_once_per_server(monkeypatch):
    """The start-up check, repr(server_args) and /server_info read one config per server; a
    changed variable or flag builds it anew."""
    from sglang.srt.kv_canary.server_args_ext import canary_repr_suffix, canary_settings

    monkeypatch.delenv("SGLANG_KV_CANARY_RING_CAPACITY", raising=False)
    calls = []
    build = CanaryConfig.from_server_args.__func__
    monkeypatch.setattr(
        CanaryConfig,
        "from_server_args",
        classmethod(lambda cls, sa: calls.append(sa) or build(cls, sa)),
    )
    args = _args()
    first = check_server_args_for_canary(args)
    assert CanaryConfig.of_server(args) is first
    assert canary_settings(args)["config"] == first.describe()
    assert f"kv_canary_config={first.describe()!r}" in canary_repr_suffix(args)
    assert len(calls) == 1
    monkeypatch.setenv("SGLANG_KV_CANARY_RING_CAPACITY", "32")
    second = CanaryConfig.of_server(args)
    assert second.ring_capacity == 32 and len(calls) == 2
    args.kv_canary = "log"
    third = CanaryConfig.of_server(args)
    assert third.mode == CanaryMode.LOG and len(calls) == 3
    assert CanaryConfig.of_server(args) is third and len(calls) == 3
    assert CanaryConfig.of_server(_args()) is not third  # another server, its own


@pytest.mark.parametrize(
    "name,value,allowed",
    [
        ("SGLANG_KV_CANARY_RING_CAPACITY", "0", "an integer from 1 to 1048576"),
        ("SGLANG_KV_CANARY_RING_CAPACITY", "many", "an integer from 1 to 1048576"),
        ("SGLANG_KV_CANARY_RING_CAPACITY", "99999999999999999999", "an integer from 1 to 1048576"),
        ("SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS", "10000000000", "an integer from 0 to 1000000000"),
        ("SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT", "maybe", "0/1"),
        ("SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS", "-1", "an integer from 0 to"),
        ("SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB", "1.5", "[0, 1]"),
        ("SGLANG_KV_CANARY_PERTURB_TARGET_GROUP", "both", "'full'"),
        ("SGLANG_KV_CANARY_PERTURB_MAX_FAULTS", "-2", "an integer from 0 to"),
        ("SGLANG_KV_CANARY_REAL_DATA_LAYERS_PER_FORWARD", "0", "an integer from 1 to 4096"),
        ("SGLANG_KV_CANARY_PERTURB_TARGET_LAYER", "top", "a layer id (0, 1, ...) or 'last'"),
        ("SGLANG_KV_CANARY_PERTURB_TARGET_LAYER", "-1", "a layer id (0, 1, ...) or 'last'"),
        ("SGLANG_KV_CANARY_PERTURB_TARGET_HALF", "both", "'k', 'v'"),
    ],
)
def test_bad_environment_values_name_the_variable(monkeypatch, name, value, allowed):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name) as exc:
        getattr(CanaryEnvs, name).get()
        CanaryConfig.from_server_args(_args())
    assert allowed in str(exc.value)


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(kv_canary="sometimes"), "invalid --kv-canary value 'sometimes'"),
        (dict(kv_canary_real_data="most"), "invalid --kv-canary-real-data value 'most'"),
        (
            dict(kv_canary_real_data_layers="some"),
            "invalid --kv-canary-real-data-layers value 'some'; allowed: first, all",
        ),
        (
            dict(kv_canary_real_data_layers="all"),
            "--kv-canary-real-data-layers=all .* needs --kv-canary-real-data partial or all",
        ),
        (dict(kv_canary="none", kv_canary_sweep_interval=4), "--kv-canary-sweep-interval=4 needs"),
        (dict(enable_torch_compile=True), "--enable-torch-compile"),
        (
            dict(enable_hierarchical_cache=True, hicache_storage_backend="file"),
            "--hicache-storage-backend file yet: pages prefetched back",
        ),
    ],
)
def test_startup_refusals_name_the_flag(kw, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        check_server_args_for_canary(_args(**kw))


@pytest.mark.parametrize(
    "kw,names",
    [
        (dict(tp_size=2, pp_size=2), ["--pp-size 2"]),
        (dict(pp_size=2), ["--pp-size 2"]),
        (dict(dp_size=2, enable_dp_attention=True), ["--dp-size 2", "--enable-dp-attention"]),
        (dict(tp_size=2, nnodes=2), ["--nnodes 2"]),
        (dict(disaggregation_mode="decode"), ["--disaggregation-mode decode"]),
        (dict(disaggregation_mode="prefill"), ["--disaggregation-mode prefill"]),
    ],
)
def test_abort_mode_refuses_what_it_cannot_abort_soundly(kw, names):
    """``--kv-canary abort`` with pipeline stages, data-parallel schedulers or DP attention,
    across nodes or across PD servers is refused at start-up, naming the flags and the modes
    to use instead."""
    with pytest.raises(ValueError, match="--kv-canary abort") as exc:
        check_server_args_for_canary(_args(kv_canary="abort", **kw))
    assert all(n in str(exc.value) for n in names) and "raise or log" in str(exc.value)
    for mode in ("raise", "log"):  # the same deployment with the other modes starts
        assert check_server_args_for_canary(_args(kv_canary=mode, **kw)).enabled


@pytest.mark.parametrize(
    "kw,names",
    [
        (dict(pp_size=2), ["--kv-canary heal runs with one scheduler rank", "--pp-size 2"]),
        (dict(disaggregation_mode="decode"), ["--kv-canary heal", "--disaggregation-mode decode"]),
        (dict(tp_size=2), ["--kv-canary heal runs with one scheduler rank, got --tp-size 2"]),
        (dict(disable_overlap_schedule=True), ["drop --disable-overlap-schedule"]),
        (
            dict(speculative_algorithm="EAGLE"),
            ["--kv-canary heal does not support --speculative-algorithm EAGLE"],
        ),
    ],
)
def test_heal_mode_refuses_what_it_cannot_heal_in(kw, names):
    """``--kv-canary heal`` refuses what abort mode refuses, and several TP ranks, sglang's
    loop without overlap and speculative decoding, naming the flag; abort mode starts with
    the last three."""
    with pytest.raises(ValueError) as exc:
        check_server_args_for_canary(_args(kv_canary="heal", **kw))
    assert all(n in str(exc.value) for n in names), str(exc.value)
    if "pp_size" not in kw and "disaggregation_mode" not in kw:
        assert check_server_args_for_canary(_args(kv_canary="abort", **kw)).mode == CanaryMode.ABORT


def test_heal_mode_parses_with_its_heal_count(monkeypatch):
    cfg = check_server_args_for_canary(_args(kv_canary=" HEAL "))
    assert cfg.mode == CanaryMode.HEAL and cfg.mode.contains and cfg.max_heals == 3
    assert "mode=heal" in cfg.describe() and "max_heals=3" in cfg.describe().split()
    assert "max_heals" not in check_server_args_for_canary(_args(kv_canary="abort")).describe()
    monkeypatch.setenv("SGLANG_KV_CANARY_MAX_HEALS", "1001")
    with pytest.raises(ValueError, match="SGLANG_KV_CANARY_MAX_HEALS.*an integer from 1 to 1000"):
        check_server_args_for_canary(_args(kv_canary="heal"))


def test_heal_modes_retirement_budget_and_the_cpus_deferred_read_back(monkeypatch):
    """``SGLANG_KV_CANARY_RETIRE_MAX_FRACTION`` (heal mode's retired slots, a fraction of the
    pool) and ``SGLANG_KV_CANARY_CPU_DEFERRED_READBACK`` parse into the config and show in its
    description; a bad value names the variable and what is allowed."""
    cfg = check_server_args_for_canary(_args(kv_canary="heal"))
    assert cfg.retire_max_fraction == 0.01 and not cfg.cpu_deferred_readback
    assert "retire_max_fraction=0.01" in cfg.describe().split()
    assert "cpu_readback=deferred" not in cfg.describe()
    monkeypatch.setenv("SGLANG_KV_CANARY_RETIRE_MAX_FRACTION", "0")
    monkeypatch.setenv("SGLANG_KV_CANARY_CPU_DEFERRED_READBACK", "1")
    cfg = check_server_args_for_canary(_args(kv_canary="heal"))
    assert cfg.retire_max_fraction == 0.0 and cfg.cpu_deferred_readback
    assert {"retire_max_fraction=0", "cpu_readback=deferred"} <= set(cfg.describe().split())
    for bad in ("1.5", "-0.1", "nan", "a tenth"):
        monkeypatch.setenv("SGLANG_KV_CANARY_RETIRE_MAX_FRACTION", bad)
        with pytest.raises(ValueError, match="SGLANG_KV_CANARY_RETIRE_MAX_FRACTION.*fraction in"):
            check_server_args_for_canary(_args(kv_canary="heal"))
    monkeypatch.delenv("SGLANG_KV_CANARY_RETIRE_MAX_FRACTION")
    monkeypatch.setenv("SGLANG_KV_CANARY_CPU_DEFERRED_READBACK", "later")
    with pytest.raises(ValueError, match="SGLANG_KV_CANARY_CPU_DEFERRED_READBACK"):
        check_server_args_for_canary(_args(kv_canary="raise"))
    for bad in (True, 2, "0.1"):
        with pytest.raises(ValueError, match="retire_max_fraction must be a number in"):
            CanaryConfig(mode=CanaryMode.HEAL, retire_max_fraction=bad)


@pytest.mark.parametrize("tp_size", [2, 8])
def test_abort_mode_starts_with_tensor_parallelism_on_one_node(tp_size):
    """TP ranks of one node agree on containment (docs/multi_rank_abort_design.md): no
    refusal."""
    cfg = check_server_args_for_canary(_args(kv_canary="abort", tp_size=tp_size))
    assert cfg.mode == CanaryMode.ABORT


def test_abort_mode_parses_on_one_rank(monkeypatch):
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_MAX_FAULTS", "1")
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB", "0.5")
    cfg = check_server_args_for_canary(
        _args(kv_canary="ABORT", tp_size=1, disaggregation_mode="null")
    )
    assert cfg.mode == CanaryMode.ABORT and cfg.perturb.max_faults == 1
    assert "mode=abort" in cfg.describe()


def test_canary_off_refuses_nothing():
    assert not check_server_args_for_canary(
        _args(kv_canary="none", device="cuda", disable_piecewise_cuda_graph=False)
    ).enabled


@pytest.mark.parametrize("kind", list(FaultKind))
def test_the_variable_parser_alone_refuses_a_probability_above_one(monkeypatch, kind):
    """Each fault probability variable is refused by its parser (not only later, by
    ``PerturbConfig``): the message names the variable and the allowed range."""
    monkeypatch.setenv(kind.env_var, "1.5")
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"invalid value '1.5' for environment variable {kind.env_var}: must be a "
            "probability in [0, 1]"
        ),
    ):
        getattr(CanaryEnvs, kind.env_var).get()
    monkeypatch.setenv(kind.env_var, "1")
    assert getattr(CanaryEnvs, kind.env_var).get() == 1.0  # the bound itself is allowed


@pytest.mark.parametrize("kind", list(FaultKind))
def test_perturb_config_alone_refuses_a_probability_above_one(kind):
    """``PerturbConfig`` refuses it too when built directly (no environment involved)."""
    field = f"{kind.value}_prob"
    with pytest.raises(
        ValueError, match=re.escape(f"{kind.env_var} must be a probability in [0, 1], got 1.5")
    ):
        PerturbConfig(target_group=PoolKind.FULL, **{field: 1.5})
    assert PerturbConfig(target_group=PoolKind.FULL, **{field: 1.0}).prob(kind) == 1.0


@pytest.mark.parametrize(
    "field,minimum,maximum",
    [
        ("ring_capacity", 1, MAX_RING_CAPACITY),
        ("sweep_interval", 0, MAX_STEP_INTERVAL),
        ("stats_print_every_n_steps", 0, MAX_STEP_INTERVAL),
        ("swa_divergence_stats_interval", 0, MAX_STEP_INTERVAL),
    ],
)
def test_config_integer_fields_are_range_checked(field, minimum, maximum):
    """``CanaryConfig`` itself (built by the driver, the builder's tests and the benchmarks,
    not only from the environment) refuses each integer setting outside its range, naming
    it; the bounds are accepted."""
    mode = dict(mode="raise")
    for bad in (minimum - 1, maximum + 1):
        with pytest.raises(
            ValueError,
            match=re.escape(
                f"CanaryConfig.{field} must be an int from {minimum} to {maximum}, got {bad}"
            ),
        ):
            CanaryConfig(**mode, **{field: bad})
    for good in (minimum, maximum):
        assert getattr(CanaryConfig(**mode, **{field: good}), field) == good


def test_real_data_layers_parse(monkeypatch):
    """Per-layer fingerprints: the flag (any case) and the layers-per-forward variable reach the config and
    the start-up line; the perturbation targets parse a layer id or ``last`` and a half."""
    monkeypatch.setenv("SGLANG_KV_CANARY_REAL_DATA_LAYERS_PER_FORWARD", "3")
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_TARGET_LAYER", " Last ")
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_TARGET_HALF", "V")
    cfg = check_server_args_for_canary(
        _args(kv_canary_real_data="all", kv_canary_real_data_layers=" ALL ")
    )
    assert cfg.real_data_layers.value == "all" and cfg.real_data_layers_per_forward == 3
    assert "real_data=all real_data_layers=all layers_per_forward=3" in cfg.describe()
    assert cfg.perturb.target_layer == "last" and cfg.perturb.target_half.value == "v"
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_TARGET_LAYER", "07")
    assert check_server_args_for_canary(_args()).perturb.target_layer == 7
    assert check_server_args_for_canary(_args()).real_data_layers.value == "first"  # default


def test_rank_targets_parse_match_and_are_checked_against_the_server(monkeypatch):
    """SGLANG_KV_CANARY_PERTURB_TP_RANK / _PP_RANK / _DP_RANK make faults happen on
    one rank only (default: every rank); a rank the server does not have is refused at
    start-up, naming the variable, the size flag and the allowed ranks."""
    from sglang.srt.kv_canary.ranks import RankFacts

    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB", "0.5")
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_TP_RANK", " 1 ")
    cfg = check_server_args_for_canary(_args(kv_canary="log", tp_size=2))
    assert cfg.perturb.target_tp_rank == 1 and cfg.perturb.target_pp_rank is None
    assert cfg.perturb.injects_on(RankFacts(tp_rank=1, tp_size=2))
    assert not cfg.perturb.injects_on(RankFacts(tp_rank=0, tp_size=2))
    with pytest.raises(
        ValueError,
        match="SGLANG_KV_CANARY_PERTURB_TP_RANK=1 but the server "
        "has --tp-size 1: allowed 0 to 0, or unset",
    ):
        check_server_args_for_canary(_args(kv_canary="log", tp_size=1))
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_TP_RANK", "")  # empty: every rank
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_PP_RANK", "1")
    cfg = check_server_args_for_canary(_args(kv_canary="log", pp_size=2))
    assert cfg.perturb.injects_on(RankFacts(tp_rank=3, tp_size=4, pp_rank=1, pp_size=2))
    assert not cfg.perturb.injects_on(RankFacts(pp_rank=0, pp_size=2))
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_DP_RANK", "x")
    with pytest.raises(ValueError, match="SGLANG_KV_CANARY_PERTURB_DP_RANK.*a rank"):
        check_server_args_for_canary(_args(kv_canary="log", pp_size=2))


def test_host_kv_needs_hicache(monkeypatch):
    """HiCache: the ``host_kv`` fault corrupts HiCache's host memory; without
    ``--enable-hierarchical-cache`` it is refused, naming the flag."""
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_HOST_KV_PROB", "0.5")
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_TARGET_GROUP", "full")
    with pytest.raises(
        ValueError,
        match="SGLANG_KV_CANARY_PERTURB_HOST_KV_PROB > 0 corrupts "
        "HiCache's host memory: pass --enable-hierarchical",
    ):
        check_server_args_for_canary(_args(kv_canary="log", kv_canary_real_data="partial"))
    cfg = check_server_args_for_canary(
        _args(kv_canary="log", kv_canary_real_data="partial", enable_hierarchical_cache=True)
    )
    assert cfg.perturb.host_kv_prob == 0.5
    with pytest.raises(ValueError, match="only real-data fingerprints see"):
        check_server_args_for_canary(_args(kv_canary="log", enable_hierarchical_cache=True))


def test_pd_transfer_fault_only_on_a_pd_decode_server(monkeypatch):
    """The ``pd_transfer`` fault corrupts what a PD decode server received: any other server
    refuses it, naming the flag and its own mode; it is a real-KV fault (real data and a
    target group needed)."""
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_PD_TRANSFER_PROB", "1")
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_TARGET_GROUP", "full")
    for mode in ("null", "prefill"):
        with pytest.raises(
            ValueError,
            match="SGLANG_KV_CANARY_PERTURB_PD_TRANSFER_PROB > 0 corrupts KV a PD decode server "
            f"received .* --disaggregation-mode decode .* --disaggregation-mode {mode}",
        ):
            check_server_args_for_canary(
                _args(kv_canary="log", kv_canary_real_data="partial", disaggregation_mode=mode)
            )
    cfg = check_server_args_for_canary(
        _args(kv_canary="log", kv_canary_real_data="partial", disaggregation_mode="decode")
    )
    assert cfg.perturb.pd_transfer_prob == 1.0
    with pytest.raises(ValueError, match="only real-data fingerprints see"):
        check_server_args_for_canary(_args(kv_canary="log", disaggregation_mode="decode"))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
