"""Start-up through sglang's own parsers, in-process (after ``load_plugins()``, as
``launch_server`` / ``sglang serve`` / ``Engine`` do): the command line (``prepare_server_args``,
``--config`` YAML included) and ``ServerArgs(**kwargs)`` (what ``Engine(...)`` builds) accept
and refuse the same values with the same messages, validation sees the parsed values, canary
variables are read only with the canary on, and ``repr(server_args)`` shows the canary's
fields."""

from __future__ import annotations

import logging
import os
import re
import sys

import pytest

from sglang.srt.kv_canary import config as config_mod
from sglang.srt.kv_canary.config import CanaryConfig
from sglang.srt.kv_canary.demo.server_harness import write_tiny_llama
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="stage-a-test-cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    """No canary variable from the outside, every warning fresh, sglang's CPU engine."""
    for name in [n for n in os.environ if n.startswith("SGLANG_KV_CANARY_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    monkeypatch.setattr(config_mod, "_warned", set(), raising=False)
    from sglang.srt.plugins import load_plugins

    load_plugins()


@pytest.fixture
def canary_log(caplog):
    """The canary's WARNING records (sglang's logging set-up may stop them propagating to
    the root logger, where caplog listens, so listen on the canary's logger itself)."""
    logger = logging.getLogger("sglang.srt.kv_canary")
    logger.addHandler(caplog.handler)
    with caplog.at_level(logging.WARNING, logger="sglang.srt.kv_canary"):
        yield caplog
    logger.removeHandler(caplog.handler)


def cli(model_dir, *argv):
    """``sglang serve`` / ``launch_server``'s parse of ``argv``."""
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(
        [
            "--model-path",
            model_dir,
            "--device",
            "cpu",
            "--skip-tokenizer-init",
            "--load-format",
            "dummy",
            *argv,
        ]
    )


def kwargs(model_dir, **kw):
    """What ``sglang.Engine(**kw)`` builds."""
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        model_path=model_dir, device="cpu", skip_tokenizer_init=True, load_format="dummy", **kw
    )


def cli_error(capsys, model_dir, *argv) -> str:
    """The message of a refused command line (argparse exits; a ValueError propagates)."""
    try:
        cli(model_dir, *argv)
    except SystemExit:
        return capsys.readouterr().err
    except ValueError as e:
        return str(e)
    raise AssertionError(f"{argv} was accepted")


# ---- the command line accepts every self-test configuration ----------------------------------


@pytest.mark.parametrize(
    "env,argv",
    [
        (
            {
                "SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB": "0.5",
                "SGLANG_KV_CANARY_PERTURB_TARGET_GROUP": "full",
            },
            ["--kv-canary", "log", "--kv-canary-real-data", "partial"],
        ),
        ({"SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB": "1"}, ["--kv-canary", "log"]),
        ({}, ["--kv-canary", "raise", "--sampling-backend", "token_oracle"]),
        (
            {
                "SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE": "1",
                "SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT": "1",
            },
            ["--kv-canary", "log"],
        ),
    ],
)
def test_self_test_configurations_start_from_the_command_line(monkeypatch, model_dir, env, argv):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    sa = cli(model_dir, *argv)
    assert sa.kv_canary == argv[1]
    assert CanaryConfig.from_server_args(sa).enabled
    sa = kwargs(
        model_dir, **{k.lstrip("-").replace("-", "_"): v for k, v in zip(argv[::2], argv[1::2])}
    )
    assert sa.kv_canary == argv[1]


def test_the_command_line_still_refuses_a_self_test_without_the_canary(
    monkeypatch, model_dir, capsys
):
    assert "needs --kv-canary log, raise, abort or heal" in cli_error(
        capsys, model_dir, "--sampling-backend", "token_oracle"
    )


# ---- one parse for every route ---------------------------------------------------------------


@pytest.mark.parametrize(
    "flag,value,canonical",
    [
        ("--kv-canary", "RAISE", "raise"),
        ("--kv-canary", " log ", "log"),
        ("--kv-canary-real-data", "ALL", "all"),
        ("--kv-canary-sweep-interval", "3", 3),
        ("--kv-canary-real-data-layers", " First ", "first"),
    ],
)
def test_the_same_spellings_are_accepted_everywhere(model_dir, flag, value, canonical):
    name = flag.lstrip("-").replace("-", "_")
    extra = [] if name == "kv_canary" else ["--kv-canary", "log"]
    extra_kw = {} if name == "kv_canary" else {"kv_canary": "log"}
    assert getattr(cli(model_dir, *extra, flag, value), name) == canonical
    assert getattr(kwargs(model_dir, **extra_kw, **{name: value}), name) == canonical


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--kv-canary", "sometimes"),
        ("--kv-canary", ""),
        ("--kv-canary", None),
        ("--kv-canary-real-data", "most"),
        ("--kv-canary-real-data", None),
        ("--kv-canary-real-data-layers", "most"),
        ("--kv-canary-real-data-layers", None),
        ("--kv-canary-sweep-interval", "abc"),
        ("--kv-canary-sweep-interval", "-1"),
        ("--kv-canary-sweep-interval", -1),
        ("--kv-canary-sweep-interval", 10**10),
        ("--kv-canary-sweep-interval", "1.5"),
        ("--kv-canary-sweep-interval", 1.5),
        ("--kv-canary-sweep-interval", True),
        ("--kv-canary-sweep-interval", str(10**10)),
    ],
)
def test_the_same_values_are_refused_everywhere_naming_the_flag(capsys, model_dir, flag, value):
    name = flag.lstrip("-").replace("-", "_")
    with pytest.raises(ValueError) as exc:
        kwargs(model_dir, **{"kv_canary": "log", name: value})
    assert flag in str(exc.value) and repr(value) in str(exc.value)
    if isinstance(value, str):  # a command line carries strings only
        argv = ([] if name == "kv_canary" else ["--kv-canary", "log"]) + [flag, value]
        message = cli_error(capsys, model_dir, *argv)
        assert flag in message, message


# ---- a canary-off server ignores (and names) canary variables --------------------------------


def test_canary_off_reads_no_variable_and_names_the_set_ones(monkeypatch, model_dir, canary_log):
    monkeypatch.setenv("SGLANG_KV_CANARY_RING_CAPACITY", "lots")  # malformed
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB", "0.5")
    for sa in (cli(model_dir), kwargs(model_dir)):
        assert not CanaryConfig.from_server_args(sa).enabled
    warnings = [r.getMessage() for r in canary_log.records if "are ignored" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once per process
    assert (
        "SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB, SGLANG_KV_CANARY_RING_CAPACITY" in warnings[0]
    )
    # the same variable stops a canary-on start, naming it
    with pytest.raises(ValueError, match="SGLANG_KV_CANARY_RING_CAPACITY"):
        kwargs(model_dir, kv_canary="log")


def test_a_misspelled_variable_gets_the_closest_name(monkeypatch, model_dir, canary_log):
    monkeypatch.setenv("SGLANG_KV_CANARY_RING_CAPACTY", "64")
    kwargs(model_dir, kv_canary="log")
    assert any(
        "unknown environment variable SGLANG_KV_CANARY_RING_CAPACTY" in r.getMessage()
        and "did you mean SGLANG_KV_CANARY_RING_CAPACITY?" in r.getMessage()
        for r in canary_log.records
    )


def test_an_absurd_ring_capacity_is_refused_naming_the_variable(monkeypatch, model_dir):
    monkeypatch.setenv("SGLANG_KV_CANARY_RING_CAPACITY", "99999999999999999999")
    with pytest.raises(ValueError, match="SGLANG_KV_CANARY_RING_CAPACITY.*from 1 to"):
        kwargs(model_dir, kv_canary="raise")


@pytest.mark.parametrize("route", ["cli", "kwargs"])
def test_real_data_without_the_canary_is_refused(capsys, model_dir, route):
    if route == "cli":
        message = cli_error(capsys, model_dir, "--kv-canary-real-data", "partial")
    else:
        with pytest.raises(ValueError) as exc:
            kwargs(model_dir, kv_canary_real_data="partial")
        message = str(exc.value)
    assert "--kv-canary-real-data=partial needs the canary on" in message


# ---- start-up tells the whole configuration --------------------------------------------------


def test_repr_and_the_installed_line_show_every_setting(monkeypatch, model_dir):
    monkeypatch.setenv("SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT", "1")
    monkeypatch.setenv("SGLANG_KV_CANARY_RING_CAPACITY", "64")
    for sa in (
        cli(model_dir, "--kv-canary", "raise", "--kv-canary-sweep-interval", "5"),
        kwargs(model_dir, kv_canary="raise", kv_canary_sweep_interval=5),
    ):
        text = repr(sa)
        described = CanaryConfig.from_server_args(sa).describe()
        # the four flags, then the effective config (environment included)
        assert text.endswith(
            "kv_canary='raise', kv_canary_sweep_interval=5, "
            "kv_canary_real_data='none', kv_canary_real_data_layers='first', "
            f"kv_canary_config={described!r})"
        ), text[-400:]
        assert "ring_capacity=64 token_checks=on" in text
        for word in (
            "mode=raise",
            "real_data=none",
            "real_data_layers=first",
            "layers_per_forward=1",
            "sweep_interval=5",
            "ring_capacity=64",
            "token_checks=on",
            "token_oracle=off",
            "write_input_check=off",
            "v_half=off",
            "stats_every=100",
            "swa_divergence_every=0",
            "fault_injection=off",
        ):
            assert word in described.split(), (word, described)


# ---- --kv-canary abort on every route --------------------------------------------------------


def test_abort_mode_starts_from_every_route(tmp_path, model_dir):
    """``abort`` parses from the command line, a ``--config`` YAML and ``Engine`` kwargs, and
    the refusal of an unsound deployment names the flags on each route."""
    yaml_file = tmp_path / "canary.yaml"
    yaml_file.write_text("kv-canary: abort\nkv-canary-sweep-interval: 4\n")
    for sa in (
        cli(model_dir, "--kv-canary", "Abort"),
        cli(model_dir, "--config", str(yaml_file)),
        kwargs(model_dir, kv_canary="abort"),
    ):
        assert sa.kv_canary == "abort"
        assert CanaryConfig.from_server_args(sa).describe().startswith("mode=abort ")
        assert "kv_canary_config='mode=abort " in repr(sa)
    # tensor parallelism on one node is served; pipeline stages and DP attention are not
    assert cli(model_dir, "--kv-canary", "abort", "--tp-size", "2").kv_canary == "abort"
    assert kwargs(model_dir, kv_canary="abort", tp_size=4).tp_size == 4
    with pytest.raises(
        ValueError,
        match="--kv-canary abort runs with one scheduler rank or with tensor parallelism on "
        "one node .*, got --pp-size 2",
    ):
        cli(model_dir, "--kv-canary", "abort", "--tp-size", "2", "--pp-size", "2")
    with pytest.raises(ValueError, match="got --dp-size 2, --enable-dp-attention"):
        kwargs(model_dir, kv_canary="abort", tp_size=2, dp_size=2, enable_dp_attention=True)


def test_heal_mode_starts_from_every_route(monkeypatch, tmp_path, model_dir, capsys):
    """``heal`` parses from the command line, a ``--config`` YAML and ``Engine`` kwargs, with
    its defaults when no variable is set and ``SGLANG_KV_CANARY_MAX_HEALS`` in its effective
    settings when one is; the deployments it cannot heal
    in are refused on each route naming the flag, and a bad heal count names the variable."""
    yaml_file = tmp_path / "canary.yaml"
    yaml_file.write_text("kv-canary: heal\n")
    for name in (
        "SGLANG_KV_CANARY_MAX_HEALS",
        "SGLANG_KV_CANARY_RETIRE_AFTER",
        "SGLANG_KV_CANARY_RETIRE_MAX_FRACTION",
    ):
        monkeypatch.delenv(name, raising=False)
    for sa in (cli(model_dir, "--kv-canary", "heal"), kwargs(model_dir, kv_canary="heal")):
        words = CanaryConfig.from_server_args(sa).describe().split()
        assert "max_heals=3" in words and "retire_after=1" in words, words
        assert "retire_max_fraction=0.01" in words, words
    monkeypatch.setenv("SGLANG_KV_CANARY_RETIRE_MAX_FRACTION", "0.05")
    for sa in (cli(model_dir, "--kv-canary", "heal"), kwargs(model_dir, kv_canary="heal")):
        assert "retire_max_fraction=0.05" in CanaryConfig.from_server_args(sa).describe().split()
    monkeypatch.delenv("SGLANG_KV_CANARY_RETIRE_MAX_FRACTION")
    monkeypatch.setenv("SGLANG_KV_CANARY_MAX_HEALS", "5")
    for sa in (
        cli(model_dir, "--kv-canary", "Heal"),
        cli(model_dir, "--config", str(yaml_file)),
        kwargs(model_dir, kv_canary="heal"),
    ):
        assert sa.kv_canary == "heal"
        described = CanaryConfig.from_server_args(sa).describe()
        assert described.startswith("mode=heal ") and "max_heals=5" in described.split()
        assert "kv_canary_config='mode=heal " in repr(sa)
    refused = "--kv-canary heal needs sglang's overlap scheduler"
    assert refused in cli_error(
        capsys, model_dir, "--kv-canary", "heal", "--disable-overlap-schedule"
    )
    with pytest.raises(ValueError, match=refused):
        kwargs(model_dir, kv_canary="heal", disable_overlap_schedule=True)
    with pytest.raises(
        ValueError, match="--kv-canary heal runs with one scheduler rank, got --tp-size 2"
    ):
        kwargs(model_dir, kv_canary="heal", tp_size=2)
    monkeypatch.setenv("SGLANG_KV_CANARY_MAX_HEALS", "0")
    err = cli_error(capsys, model_dir, "--kv-canary", "heal")
    assert "SGLANG_KV_CANARY_MAX_HEALS" in err and "an integer from 1 to 1000" in err, err


def test_help_lists_abort(capsys, model_dir):
    with pytest.raises(SystemExit):
        cli(model_dir, "--help")
    out = capsys.readouterr().out
    assert "{none,log,raise,abort,heal}" in out and "'abort' logs it" in out.replace("\n", " ")


def test_every_layer_starts_from_the_command_line_and_yaml(tmp_path, model_dir, capsys):
    """``--kv-canary-real-data-layers all`` through the command line, a ``--config``
    YAML file and the keyword arguments gives one config; without real data it is refused,
    naming both flags, on every route."""
    yaml = tmp_path / "canary.yaml"
    yaml.write_text(
        "kv-canary: raise\nkv-canary-real-data: partial\nkv-canary-real-data-layers: all\n"
    )
    for sa in (
        cli(
            model_dir,
            "--kv-canary",
            "raise",
            "--kv-canary-real-data",
            "partial",
            "--kv-canary-real-data-layers",
            "ALL",
        ),
        cli(model_dir, "--config", str(yaml)),
        kwargs(
            model_dir,
            kv_canary="raise",
            kv_canary_real_data="partial",
            kv_canary_real_data_layers="all",
        ),
    ):
        assert sa.kv_canary_real_data_layers == "all"
        assert "real_data_layers=all" in CanaryConfig.from_server_args(sa).describe()
    message = cli_error(
        capsys, model_dir, "--kv-canary", "raise", "--kv-canary-real-data-layers", "all"
    )
    assert "--kv-canary-real-data-layers=all" in message
    assert "--kv-canary-real-data partial or all" in message
    with pytest.raises(ValueError, match="--kv-canary-real-data partial or all"):
        kwargs(model_dir, kv_canary="raise", kv_canary_real_data_layers="all")


# ---- speculative decoding: the same refusals and fault targets from every route ---------------


def _eagle(model_dir, topk, algorithm="EAGLE"):
    return [
        "--speculative-algorithm",
        algorithm,
        "--speculative-draft-model-path",
        model_dir,
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        str(topk),
        "--speculative-num-draft-tokens",
        "4",
    ]


def _eagle_kwargs(model_dir, topk, algorithm="EAGLE"):
    return dict(
        speculative_algorithm=algorithm,
        speculative_draft_model_path=model_dir,
        speculative_num_steps=3,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=4,
    )


def test_eagle_chains_and_trees_start_at_every_page_size_from_every_route(
    capsys, tmp_path, model_dir
):
    """EAGLE with the canary: topk 1 and a draft tree (topk 2) start from the command line
    and ``Engine`` kwargs; a draft tree at page size 16 (sglang runs it with flashinfer or fa3;
    the draft round copies the prefix's partial page into every lane with ``move_kv_cache``,
    which the records follow) starts from the command line, a ``--config`` YAML and ``Engine``
    kwargs; with another attention backend sglang's own refusal stands."""
    for topk in (1, 2):
        args = cli(model_dir, "--kv-canary", "raise", *_eagle(model_dir, topk))
        assert args.kv_canary == "raise" and args.speculative_eagle_topk == topk
        kwargs(model_dir, kv_canary="raise", **_eagle_kwargs(model_dir, topk))
    paged = ["--page-size", "16", "--attention-backend", "flashinfer"]
    args = cli(model_dir, "--kv-canary", "raise", *_eagle(model_dir, 2), *paged)
    assert (args.kv_canary, args.speculative_eagle_topk, args.page_size) == ("raise", 2, 16)
    yaml_file = tmp_path / "paged_tree.yaml"
    yaml_file.write_text("kv-canary: log\npage-size: 16\nattention-backend: fa3\n")
    args = cli(model_dir, "--config", str(yaml_file), *_eagle(model_dir, 2))
    assert (args.kv_canary, args.page_size, args.attention_backend) == ("log", 16, "fa3")
    sa = kwargs(
        model_dir,
        kv_canary="raise",
        page_size=16,
        attention_backend="flashinfer",
        **_eagle_kwargs(model_dir, 2),
    )
    assert (sa.kv_canary, sa.page_size, sa.speculative_eagle_topk) == ("raise", 16, 2)
    refused = "only supported for the 'flashinfer' backend"  # sglang's, canary on or off
    triton = ["--page-size", "16", "--attention-backend", "triton"]
    for mode in ("raise", "none"):
        assert refused in cli_error(
            capsys, model_dir, "--kv-canary", mode, *_eagle(model_dir, 2), *triton
        )


def test_the_token_oracle_starts_with_speculative_decoding_from_every_route(
    monkeypatch, capsys, tmp_path, model_dir
):
    """The token oracle (its verify hooks commit the oracle's tokens) with EAGLE chains and
    trees, STANDALONE and NGRAM: from the command line (``--sampling-backend token_oracle``),
    a ``--config`` YAML, ``Engine`` kwargs and the variables
    ``SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE`` / ``..._WRITE_INPUT_ASSERT``; sglang's simulated
    acceptance refused naming its variable."""
    oracle = ["--sampling-backend", "token_oracle"]
    for topk in (1, 2):
        args = cli(model_dir, "--kv-canary", "raise", *oracle, *_eagle(model_dir, topk))
        assert CanaryConfig.from_server_args(args).enable_token_oracle
        sa = kwargs(
            model_dir,
            kv_canary="raise",
            sampling_backend="token_oracle",
            **_eagle_kwargs(model_dir, topk),
        )
        assert CanaryConfig.from_server_args(sa).enable_token_oracle
    yaml_file = tmp_path / "oracle.yaml"
    yaml_file.write_text("kv-canary: log\nsampling-backend: token_oracle\n")
    args = cli(model_dir, "--config", str(yaml_file), *_eagle(model_dir, 2, "STANDALONE"))
    assert CanaryConfig.from_server_args(args).enable_token_oracle
    ngram = ["--speculative-algorithm", "NGRAM", "--device", "cuda"]
    assert cli(model_dir, "--kv-canary", "raise", *oracle, *ngram).speculative_algorithm == "NGRAM"
    monkeypatch.setenv("SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE", "1")
    monkeypatch.setenv("SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT", "1")
    for sa in (
        cli(model_dir, "--kv-canary", "log", *_eagle(model_dir, 1)),
        kwargs(model_dir, kv_canary="log", **_eagle_kwargs(model_dir, 2)),
    ):
        config = CanaryConfig.from_server_args(sa)
        assert config.enable_token_oracle and config.enable_write_input_assert
    from sglang.srt.environ import envs

    monkeypatch.setenv("SGLANG_SIMULATE_ACC_LEN", "3")
    assert envs.SGLANG_SIMULATE_ACC_LEN.get() == 3
    message = cli_error(capsys, model_dir, "--kv-canary", "log", *_eagle(model_dir, 1))
    assert "SGLANG_SIMULATE_ACC_LEN=3" in message, message
    with pytest.raises(ValueError, match="SGLANG_SIMULATE_ACC_LEN=3"):
        kwargs(model_dir, kv_canary="log", **_eagle_kwargs(model_dir, 1))


def test_standalone_starts_with_chains_and_trees_from_every_route(capsys, monkeypatch, model_dir):
    """STANDALONE (a separate draft LM) with the canary: accepted at topk 1 from the command
    line and ``Engine`` kwargs, also with ``SGLANG_KV_CANARY_PERTURB_TARGET_WORKER=draft``
    (it has a draft pool), and at topk 2 (a draft tree) on each route, also at page size
    16."""
    flags, tree = (_eagle(model_dir, k, "STANDALONE") for k in (1, 2))
    kw = _eagle_kwargs(model_dir, 1, "STANDALONE")
    args = cli(model_dir, "--kv-canary", "raise", *flags)
    assert args.speculative_algorithm == "STANDALONE" and args.kv_canary == "raise"
    kwargs(model_dir, kv_canary="raise", **kw)
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_TARGET_WORKER", "draft")
    cli(model_dir, "--kv-canary", "log", *flags)
    kwargs(model_dir, kv_canary="log", **kw)
    monkeypatch.delenv("SGLANG_KV_CANARY_PERTURB_TARGET_WORKER")
    assert cli(model_dir, "--kv-canary", "raise", *tree).speculative_eagle_topk == 2
    kwargs(model_dir, kv_canary="raise", **_eagle_kwargs(model_dir, 2, "STANDALONE"))
    paged = ["--page-size", "16", "--attention-backend", "flashinfer"]
    assert cli(model_dir, "--kv-canary", "raise", *tree, *paged).page_size == 16


def test_ngram_starts_at_every_page_size_from_every_route(monkeypatch, capsys, tmp_path, model_dir):
    """NGRAM with the canary (sglang's defaults: breadth 10 as topk, 12 draft tokens; CUDA
    only, so these servers say ``--device cuda``; no GPU is touched to parse them): starts from
    the command line, a ``--config`` YAML and ``Engine`` kwargs, at page size 1 and at page
    size 16 (sglang runs it with flashinfer; its accepted nodes' KV is compacted with
    ``move_kv_cache``, which the records follow); the draft fault target refused naming the
    variable."""
    ngram = ["--speculative-algorithm", "NGRAM", "--device", "cuda"]
    paged = ["--page-size", "16", "--attention-backend", "flashinfer"]
    args = cli(model_dir, "--kv-canary", "raise", *ngram)
    assert (args.kv_canary, args.speculative_eagle_topk) == ("raise", 10)
    args = cli(model_dir, "--kv-canary", "raise", *ngram, *paged)
    assert (args.kv_canary, args.page_size) == ("raise", 16)
    yaml_file = tmp_path / "ngram.yaml"
    yaml_file.write_text("kv-canary: log\npage-size: 16\nattention-backend: flashinfer\n")
    args = cli(model_dir, "--config", str(yaml_file), *ngram)
    assert (args.kv_canary, args.page_size) == ("log", 16)
    from sglang.srt.server_args import ServerArgs

    def engine(**kw):
        return ServerArgs(
            model_path=model_dir,
            device="cuda",
            skip_tokenizer_init=True,
            load_format="dummy",
            speculative_algorithm="NGRAM",
            **kw,
        )

    assert engine(kv_canary="raise").speculative_num_draft_tokens == 12
    assert engine(kv_canary="raise", page_size=16, attention_backend="flashinfer").page_size == 16
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB", "0.1")
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_TARGET_WORKER", "draft")
    assert "NGRAM has none" in cli_error(capsys, model_dir, "--kv-canary", "log", *ngram)
    with pytest.raises(ValueError, match="TARGET_WORKER=draft .*NGRAM has none"):
        engine(kv_canary="log")


def test_frozen_kv_mtp_starts_with_chains_and_trees_from_every_route(
    monkeypatch, capsys, tmp_path, model_dir
):
    """FROZEN_KV_MTP with the canary (its draft reads the target's KV and writes none; sglang
    sets no defaults for it: steps, topk and draft tokens given): named on the command line,
    promoted by sglang from NEXTN for a Gemma4 assistant draft, from a ``--config`` YAML and
    ``Engine`` kwargs, with chains and with trees at page size 16 (the target's compaction is
    followed); the draft fault target refused naming the variable. (sglang decides the
    algorithm from the draft's ``architectures``: a tiny Llama config naming
    ``Gemma4AssistantForCausalLM`` is enough to parse; no model is built.)"""
    draft = write_tiny_llama(tmp_path / "assistant", architectures=["Gemma4AssistantForCausalLM"])
    chain = ["--speculative-num-steps", "2", "--speculative-eagle-topk", "1"]
    chain += ["--speculative-num-draft-tokens", "3", "--speculative-draft-model-path", draft]
    tree = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "2"]
    tree += ["--speculative-num-draft-tokens", "6", "--speculative-draft-model-path", draft]
    frozen = ["--speculative-algorithm", "FROZEN_KV_MTP"]
    args = cli(model_dir, "--kv-canary", "raise", *frozen, *chain)
    assert (args.kv_canary, args.speculative_algorithm) == ("raise", "FROZEN_KV_MTP")
    args = cli(model_dir, "--kv-canary", "raise", "--speculative-algorithm", "NEXTN", *chain)
    assert args.speculative_algorithm == "FROZEN_KV_MTP"  # sglang's promotion
    args = cli(model_dir, "--kv-canary", "log", *frozen, *tree, "--page-size", "16")
    assert (args.speculative_eagle_topk, args.page_size) == (2, 16)
    yaml_file = tmp_path / "frozen.yaml"
    yaml_file.write_text(
        "kv-canary: abort\nspeculative-algorithm: FROZEN_KV_MTP\nspeculative-num-steps: 2\n"
        "speculative-eagle-topk: 1\nspeculative-num-draft-tokens: 3\n"
        f"speculative-draft-model-path: {draft}\n"
    )
    args = cli(model_dir, "--config", str(yaml_file))
    assert (args.kv_canary, args.speculative_algorithm) == ("abort", "FROZEN_KV_MTP")
    engine = dict(
        speculative_algorithm="FROZEN_KV_MTP",
        speculative_draft_model_path=draft,
        speculative_num_steps=2,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=3,
    )
    assert kwargs(model_dir, kv_canary="raise", **engine).speculative_algorithm == "FROZEN_KV_MTP"
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB", "0.1")
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_TARGET_WORKER", "draft")
    refused = "FROZEN_KV_MTP has none (its draft reads the target's KV and writes none)"
    assert refused in cli_error(capsys, model_dir, "--kv-canary", "log", *frozen, *chain)
    with pytest.raises(ValueError, match="TARGET_WORKER=draft .*FROZEN_KV_MTP has none"):
        kwargs(model_dir, kv_canary="log", **engine)


def test_dflash_starts_from_every_route(tmp_path, model_dir):
    """DFLASH with the canary (sglang forces steps and topk 1; the block size is given, so
    no draft config is read to parse): accepted from the command line, a ``--config`` YAML
    and ``Engine`` kwargs, at page size 1 and 16, with ``--enable-hierarchical-cache`` and with
    ``--speculative-draft-window-size``."""
    dflash = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", model_dir]
    dflash += ["--speculative-num-draft-tokens", "4"]
    args = cli(model_dir, "--kv-canary", "raise", *dflash)
    assert (args.kv_canary, args.speculative_algorithm) == ("raise", "DFLASH")
    assert (args.speculative_num_steps, args.speculative_eagle_topk) == (1, 1)
    yaml_file = tmp_path / "dflash.yaml"
    yaml_file.write_text(
        "kv-canary: log\nspeculative-algorithm: DFLASH\nspeculative-num-draft-tokens: 4\n"
        f"speculative-draft-model-path: {model_dir}\n"
    )
    assert cli(model_dir, "--config", str(yaml_file)).speculative_algorithm == "DFLASH"
    engine = dict(
        speculative_algorithm="DFLASH",
        speculative_draft_model_path=model_dir,
        speculative_num_draft_tokens=4,
    )
    assert kwargs(model_dir, kv_canary="abort", **engine).speculative_num_draft_tokens == 4
    assert cli(model_dir, "--kv-canary", "raise", *dflash, "--page-size", "16").page_size == 16
    paged_yaml = tmp_path / "dflash_paged.yaml"
    paged_yaml.write_text(yaml_file.read_text() + "page-size: 16\n")
    assert cli(model_dir, "--config", str(paged_yaml)).page_size == 16
    assert kwargs(model_dir, kv_canary="raise", page_size=16, **engine).page_size == 16
    hicache = cli(model_dir, "--kv-canary", "raise", *dflash, "--enable-hierarchical-cache")
    assert hicache.enable_hierarchical_cache
    hicache_yaml = tmp_path / "dflash_hicache.yaml"
    hicache_yaml.write_text(yaml_file.read_text() + "enable-hierarchical-cache: true\n")
    assert cli(model_dir, "--config", str(hicache_yaml)).enable_hierarchical_cache
    kw = dict(engine, enable_hierarchical_cache=True)
    assert kwargs(model_dir, kv_canary="raise", **kw).enable_hierarchical_cache
    window = ["--speculative-draft-window-size", "8"]
    assert (
        cli(model_dir, "--kv-canary", "raise", *dflash, *window).speculative_draft_window_size == 8
    )
    window_yaml = tmp_path / "dflash_window.yaml"
    window_yaml.write_text(yaml_file.read_text() + "speculative-draft-window-size: 8\n")
    assert cli(model_dir, "--config", str(window_yaml)).speculative_draft_window_size == 8
    kw = dict(engine, speculative_draft_window_size=8, page_size=16)
    assert kwargs(model_dir, kv_canary="raise", **kw).speculative_draft_window_size == 8


def test_dflash_with_the_token_oracle_starts_from_every_route(tmp_path, model_dir, monkeypatch):
    """The token oracle with DFLASH (its verify commits the oracle's tokens:
    ``plugin._dflash_verify``) starts from the command line's sampling backend, a ``--config``
    YAML, ``Engine`` kwargs and the oracle's variables (alone, and with the write-input
    check)."""
    dflash = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", model_dir]
    dflash += ["--speculative-num-draft-tokens", "4"]
    oracle = ["--sampling-backend", "token_oracle"]
    args = cli(model_dir, "--kv-canary", "raise", *dflash, *oracle)
    assert args.speculative_algorithm == "DFLASH"
    assert CanaryConfig.from_server_args(args).enable_token_oracle
    yaml_file = tmp_path / "dflash_oracle.yaml"
    yaml_file.write_text(
        "kv-canary: raise\nspeculative-algorithm: DFLASH\nspeculative-num-draft-tokens: 4\n"
        f"speculative-draft-model-path: {model_dir}\nsampling-backend: token_oracle\n"
    )
    args = cli(model_dir, "--config", str(yaml_file))
    assert CanaryConfig.from_server_args(args).enable_token_oracle
    engine = dict(
        speculative_algorithm="DFLASH",
        speculative_draft_model_path=model_dir,
        speculative_num_draft_tokens=4,
    )
    kw = dict(engine, sampling_backend="token_oracle")
    assert CanaryConfig.from_server_args(
        kwargs(model_dir, kv_canary="raise", **kw)
    ).enable_token_oracle
    # the oracle's variable alone, then with the write-input check (which needs the oracle)
    for env in (
        ("SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE",),
        ("SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE", "SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT"),
    ):
        for var in env:
            monkeypatch.setenv(var, "1")
        for sa in (
            cli(model_dir, "--kv-canary", "raise", *dflash),
            kwargs(model_dir, kv_canary="raise", **engine),
        ):
            config = CanaryConfig.from_server_args(sa)
            assert sa.speculative_algorithm == "DFLASH" and config.enable_token_oracle
            assert config.enable_write_input_assert == (len(env) == 2)
        for var in env:
            monkeypatch.delenv(var)


# EAGLE on the tiny Step-3.5 (sglang turns multi-layer EAGLE on by itself): 3 steps, topk 1,
# 4 draft tokens, as command-line flags and as Engine kwargs
STEP3P5_EAGLE_ARGS = (
    "--speculative-algorithm",
    "EAGLE",
    "--speculative-num-steps",
    "3",
    "--speculative-eagle-topk",
    "1",
    "--speculative-num-draft-tokens",
    "4",
)
STEP3P5_EAGLE_ENGINE = dict(
    speculative_algorithm="EAGLE",
    speculative_num_steps=3,
    speculative_eagle_topk=1,
    speculative_num_draft_tokens=4,
)


def test_a_step3p5_target_with_eagle_is_refused_from_every_route(capsys, tmp_path, monkeypatch):
    """A Step-3.5 target with ``--speculative-algorithm EAGLE`` (the overlap scheduler on:
    spec v2) and CUDA graphs: sglang turns on ``--enable-multi-layer-eagle`` by itself, whose
    per-layer draft-extend graphs the canary does not cover; the refusal says so (the operator
    never passed the flag) from the command line, a ``--config`` YAML and ``Engine`` kwargs,
    with and without the canary's variables. The same server without the canary starts, with
    the flag on; with ``--disable-cuda-graph`` it starts with the canary
    (``test_a_step3p5_target_with_eager_spec_v2_eagle_starts_from_every_route``)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from canary_support.tiny_models import write_tiny_step3p5

    step = write_tiny_step3p5(tmp_path / "step3p5")
    eagle = list(STEP3P5_EAGLE_ARGS)
    refused = "sglang also turns it on by itself for MiMoV2 and Step-3.5 targets"
    assert refused in cli_error(capsys, step, "--kv-canary", "raise", *eagle)
    yaml_file = tmp_path / "step3p5_eagle.yaml"
    yaml_file.write_text(
        "kv-canary: log\nspeculative-algorithm: EAGLE\nspeculative-num-steps: 3\n"
        "speculative-eagle-topk: 1\nspeculative-num-draft-tokens: 4\n"
    )
    assert refused in cli_error(capsys, step, "--config", str(yaml_file))
    engine = dict(STEP3P5_EAGLE_ENGINE)
    with pytest.raises(ValueError, match=refused):
        kwargs(step, kv_canary="abort", **engine)
    assert kwargs(step, **engine).enable_multi_layer_eagle
    assert cli(step, *eagle).enable_multi_layer_eagle
    # with the canary's variables set, the same refusal
    monkeypatch.setenv("SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT", "1")
    monkeypatch.setenv("SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS", "10")
    assert refused in cli_error(capsys, step, "--kv-canary", "raise", *eagle)
    with pytest.raises(ValueError, match=refused):
        kwargs(step, kv_canary="log", **engine)


def test_a_step3p5_target_with_eager_spec_v2_eagle_starts_from_every_route(
    capsys, tmp_path, monkeypatch
):
    """The same Step-3.5 target with EAGLE, the overlap scheduler on (spec v2) and
    ``--disable-cuda-graph``: multi-layer EAGLE's MTP steps then all run eagerly on MTP layer
    0's pool, which the canary guards (``test_speculative_multi_layer.py``): accepted from the
    command line, a ``--config`` YAML and ``Engine`` kwargs, with and without the canary's
    variables, the flag on and spec v2 kept. With ``SGLANG_KV_CANARY_DRAFT_VIOLATIONS=act``,
    abort is refused naming the variable (the MTP draft pool holds sliding-window layers only:
    no record of a slot's request to contain; heal is refused with any speculative decoding),
    raise still starts."""
    sys.path.insert(0, os.path.dirname(__file__))
    from canary_support.tiny_models import write_tiny_step3p5

    step = write_tiny_step3p5(tmp_path / "step3p5")
    eagle = list(STEP3P5_EAGLE_ARGS)
    eager = ["--disable-cuda-graph"]
    engine = dict(
        **STEP3P5_EAGLE_ENGINE,
        disable_cuda_graph=True,
    )
    yaml_file = tmp_path / "step3p5_eagle_eager.yaml"
    yaml_file.write_text(
        "kv-canary: log\nspeculative-algorithm: EAGLE\nspeculative-num-steps: 3\n"
        "speculative-eagle-topk: 1\nspeculative-num-draft-tokens: 4\n"
        "disable-cuda-graph: true\n"
    )

    def accepted_on_every_route():
        for args, mode in (
            (cli(step, "--kv-canary", "raise", *eagle, *eager), "raise"),
            (cli(step, "--config", str(yaml_file)), "log"),
            (kwargs(step, kv_canary="abort", **engine), "abort"),
        ):
            assert args.kv_canary == mode and args.enable_multi_layer_eagle
            assert args.disable_cuda_graph and not args.disable_overlap_schedule

    accepted_on_every_route()
    monkeypatch.setenv("SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT", "1")
    monkeypatch.setenv("SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS", "10")
    accepted_on_every_route()

    monkeypatch.setenv("SGLANG_KV_CANARY_DRAFT_VIOLATIONS", "act")
    refused = "SGLANG_KV_CANARY_DRAFT_VIOLATIONS=act cannot act on --enable-multi-layer-eagle"
    assert refused in cli_error(capsys, step, "--kv-canary", "abort", *eagle, *eager)
    yaml_file.write_text(yaml_file.read_text().replace("kv-canary: log", "kv-canary: abort"))
    assert refused in cli_error(capsys, step, "--config", str(yaml_file))
    with pytest.raises(ValueError, match=re.escape(refused)):
        kwargs(step, kv_canary="abort", **engine)
    assert cli(step, "--kv-canary", "raise", *eagle, *eager).enable_multi_layer_eagle


def test_a_step3p5_target_with_spec_v1_eagle_is_left_to_sglangs_own_error(
    capsys, tmp_path, monkeypatch
):
    """The same Step-3.5 target with EAGLE and ``--disable-overlap-schedule`` (spec v1): the
    canary does not refuse it from the command line, a ``--config`` YAML or ``Engine`` kwargs,
    with and without the canary's variables (sglang 0.5.12's spec v1 multi-layer worker fails
    to import whatever the canary does: ``test_multi_layer_eagle_sglang.py``); an explicit
    ``--enable-multi-layer-eagle`` with spec v1 alike, and with spec v2 and CUDA graphs still
    refused."""
    sys.path.insert(0, os.path.dirname(__file__))
    from canary_support.tiny_models import write_tiny_step3p5

    step = write_tiny_step3p5(tmp_path / "step3p5")
    eagle = list(STEP3P5_EAGLE_ARGS)
    v1 = ["--disable-overlap-schedule"]
    engine = dict(
        **STEP3P5_EAGLE_ENGINE,
        disable_overlap_schedule=True,
    )
    yaml_file = tmp_path / "step3p5_eagle_v1.yaml"
    yaml_file.write_text(
        "kv-canary: log\nspeculative-algorithm: EAGLE\nspeculative-num-steps: 3\n"
        "speculative-eagle-topk: 1\nspeculative-num-draft-tokens: 4\n"
        "disable-overlap-schedule: true\n"
    )

    def accepted_on_every_route():
        args = cli(step, "--kv-canary", "raise", *eagle, *v1)
        assert args.kv_canary == "raise" and args.enable_multi_layer_eagle
        assert args.disable_overlap_schedule
        args = cli(step, "--config", str(yaml_file))
        assert args.kv_canary == "log" and args.enable_multi_layer_eagle
        args = kwargs(step, kv_canary="abort", **engine)
        assert args.kv_canary == "abort" and args.enable_multi_layer_eagle

    accepted_on_every_route()
    monkeypatch.setenv("SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT", "1")
    monkeypatch.setenv("SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS", "10")
    accepted_on_every_route()
    explicit = ["--enable-multi-layer-eagle"]
    assert cli(step, "--kv-canary", "raise", *eagle, *v1, *explicit).enable_multi_layer_eagle
    assert "with the overlap scheduler (spec v2)" in cli_error(
        capsys, step, "--kv-canary", "raise", *eagle, *explicit
    )


def test_adaptive_steps_start_from_every_route(capsys, tmp_path, model_dir):
    """``--speculative-adaptive`` with the canary: accepted from the command line, a
    ``--config`` YAML and ``Engine`` kwargs; a ``--speculative-adaptive-config`` file sglang
    cannot read is refused on each route, naming that flag."""
    config = tmp_path / "adaptive.json"
    config.write_text('{"candidate_steps": [1, 2, 5]}')
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")  # sglang's config is a JSON object
    flags = ["--speculative-adaptive", "--speculative-adaptive-config"]
    args = cli(model_dir, "--kv-canary", "raise", *_eagle(model_dir, 1), *flags, str(config))
    assert args.speculative_adaptive and args.kv_canary == "raise"
    yaml_file = tmp_path / "canary.yaml"
    yaml_file.write_text(
        f"kv-canary: raise\nspeculative-adaptive: true\nspeculative-adaptive-config: {config}\n"
    )
    args = cli(model_dir, "--config", str(yaml_file), *_eagle(model_dir, 1))
    assert args.speculative_adaptive and args.kv_canary == "raise"
    kw = dict(_eagle_kwargs(model_dir, 1), speculative_adaptive=True)
    assert kwargs(model_dir, kv_canary="raise", speculative_adaptive_config=str(config), **kw)
    assert "--speculative-adaptive-config" in cli_error(
        capsys, model_dir, "--kv-canary", "raise", *_eagle(model_dir, 1), *flags, str(bad)
    )
    with pytest.raises(ValueError, match="--speculative-adaptive-config"):
        kwargs(model_dir, kv_canary="raise", speculative_adaptive_config=str(bad), **kw)


def test_draft_fault_target_from_every_route(monkeypatch, capsys, model_dir):
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB", "0.1")
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_TARGET_WORKER", "draft")
    cli(model_dir, "--kv-canary", "log", *_eagle(model_dir, 1))
    kwargs(model_dir, kv_canary="log", **_eagle_kwargs(model_dir, 1))
    assert "TARGET_WORKER=draft corrupts a speculative draft" in cli_error(
        capsys, model_dir, "--kv-canary", "log"
    )
    with pytest.raises(ValueError, match="TARGET_WORKER=draft corrupts a speculative draft"):
        kwargs(model_dir, kv_canary="log")
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_TARGET_WORKER", "both")
    assert "SGLANG_KV_CANARY_PERTURB_TARGET_WORKER" in cli_error(
        capsys, model_dir, "--kv-canary", "log", *_eagle(model_dir, 1)
    )


def test_draft_violations_from_every_route(monkeypatch, capsys, tmp_path, model_dir):
    """``SGLANG_KV_CANARY_DRAFT_VIOLATIONS``: ``act`` accepted with speculative decoding from
    the command line, a ``--config`` YAML and ``Engine`` kwargs (the effective config says
    so, as does the default ``report``), refused without it on each route naming the
    variable; a misspelt value refused naming the variable and the allowed values."""
    from sglang.srt.kv_canary.config import CanaryConfig

    args = cli(model_dir, "--kv-canary", "raise", *_eagle(model_dir, 1))
    assert "draft_violations=report" in CanaryConfig.of_server(args).describe()
    monkeypatch.setenv("SGLANG_KV_CANARY_DRAFT_VIOLATIONS", "act")
    args = cli(model_dir, "--kv-canary", "raise", *_eagle(model_dir, 1))
    assert "draft_violations=act" in CanaryConfig.of_server(args).describe()
    yaml_file = tmp_path / "canary.yaml"
    yaml_file.write_text("kv-canary: abort\n")
    cli(model_dir, "--config", str(yaml_file), *_eagle(model_dir, 1))
    assert kwargs(model_dir, kv_canary="raise", **_eagle_kwargs(model_dir, 1))
    refused = "SGLANG_KV_CANARY_DRAFT_VIOLATIONS=act acts on a speculative draft"
    assert refused in cli_error(capsys, model_dir, "--kv-canary", "raise")
    assert refused in cli_error(capsys, model_dir, "--config", str(yaml_file))
    with pytest.raises(ValueError, match=refused):
        kwargs(model_dir, kv_canary="raise")
    monkeypatch.setenv("SGLANG_KV_CANARY_DRAFT_VIOLATIONS", "acts")
    err = cli_error(capsys, model_dir, "--kv-canary", "raise", *_eagle(model_dir, 1))
    assert "SGLANG_KV_CANARY_DRAFT_VIOLATIONS" in err and "'report', 'act'" in err, err


def test_the_kept_req_to_token_fault_starts_in_abort_mode_only_from_every_route(
    monkeypatch, capsys, tmp_path, model_dir
):
    """``SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_KEPT_PROB`` (a corrupt entry left in place):
    accepted with ``--kv-canary abort`` from the command line, a ``--config`` YAML and
    ``Engine`` kwargs, refused with ``log`` on each route naming the variable and the mode;
    unset, ``log`` starts as before."""
    yaml_file = tmp_path / "canary.yaml"
    yaml_file.write_text("kv-canary: abort\n")
    refusal = "SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_KEPT_PROB > 0 leaves a corrupt"
    assert CanaryConfig.from_server_args(cli(model_dir, "--kv-canary", "log")).enabled
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_KEPT_PROB", "0.01")
    for sa in (
        cli(model_dir, "--kv-canary", "abort"),
        cli(model_dir, "--config", str(yaml_file)),
        kwargs(model_dir, kv_canary="abort"),
    ):
        assert "fault_injection=req_to_token_kept" in CanaryConfig.from_server_args(sa).describe()
    assert refusal in cli_error(capsys, model_dir, "--kv-canary", "log")
    with pytest.raises(ValueError, match="only --kv-canary abort or heal contains"):
        kwargs(model_dir, kv_canary="log")


def test_the_pd_transfer_fault_starts_on_a_pd_decode_server_only_from_every_route(
    monkeypatch, capsys, tmp_path, model_dir
):
    """``SGLANG_KV_CANARY_PERTURB_PD_TRANSFER_PROB`` (a byte of a received page): accepted on a
    PD decode server from the command line, a ``--config`` YAML and ``Engine`` kwargs, refused
    on a server of any other mode on each route, naming the variable and the server's mode;
    unset, the same server starts as before."""
    decode = ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "fake"]
    flags = ["--kv-canary", "log", "--kv-canary-real-data", "partial"]
    yaml_file = tmp_path / "canary.yaml"
    yaml_file.write_text(
        "kv-canary: log\nkv-canary-real-data: partial\ndisaggregation-mode: decode\n"
        "disaggregation-transfer-backend: fake\n"
    )
    engine = dict(
        kv_canary="log",
        kv_canary_real_data="partial",
        disaggregation_transfer_backend="fake",
    )
    assert CanaryConfig.from_server_args(cli(model_dir, *flags)).enabled
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_PD_TRANSFER_PROB", "1")
    monkeypatch.setenv("SGLANG_KV_CANARY_PERTURB_TARGET_GROUP", "full")
    for sa in (
        cli(model_dir, *flags, *decode),
        cli(model_dir, "--config", str(yaml_file)),
        kwargs(model_dir, disaggregation_mode="decode", **engine),
    ):
        assert "fault_injection=pd_transfer" in CanaryConfig.from_server_args(sa).describe()
    refusal = "SGLANG_KV_CANARY_PERTURB_PD_TRANSFER_PROB > 0 corrupts KV a PD decode server"
    error = cli_error(capsys, model_dir, *flags)
    assert refusal in error and "--disaggregation-mode null" in error
    with pytest.raises(ValueError, match="this one has --disaggregation-mode prefill"):
        kwargs(
            model_dir,
            **dict(engine, disaggregation_transfer_backend="mooncake"),
            disaggregation_mode="prefill",
        )


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
