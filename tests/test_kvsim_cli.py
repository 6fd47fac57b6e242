"""``python -m kvsim``: JSON, table, plot, flag checks, hitrate, and the real Mooncake trace if present."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from kvsim.cli import main
from kvsim.trace import read_trace

MINI = str(Path(__file__).parent / "kvsim_fixtures" / "mini_mooncake.jsonl")
REAL = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
ARGS = ["trace", "replay", MINI, "--gpu-kv", "8GiB", "--time-scale", "4", "--tier", "none", "--tier", "disk:32GiB"]


def test_json_is_byte_identical_across_runs(capsys):
    assert main(ARGS + ["--json"]) == 0
    first = capsys.readouterr().out
    assert main(ARGS + ["--json"]) == 0
    assert capsys.readouterr().out == first
    doc = json.loads(first)
    assert [t["tier"] for t in doc["tiers"]] == ["none", "disk:32GiB"]
    assert doc["tiers"][1]["offload_hit_rate"] > 0 and doc["tiers"][0]["bytes_stored"] == 0
    assert doc["io_profile"] == "h200-ramdrive" and doc["scenario"] is None


def test_the_default_replay_shows_both_disk_tiers_and_each_phase(capsys):
    assert main(["trace", "replay"]) == 0
    captured = capsys.readouterr()
    out = " ".join(captured.out.split(" \n"))  # the title is word-wrapped to the width
    assert "scenario dram-limited-nvme" in out and "qwen3-32b on one H200" in out and "IO profile h200-ramdrive" in out
    for text in ("vllm-disk:200GiB", "disk:100GiB", "cpu:8GiB+disk:200GiB", "fill TTFT P50", "reload TTFT P99",
                 "IO threads busy", "stores queued at the end"):
        assert text in out
    # Which scenario, hardware and profile ran, on stderr; no warning for a drive a deployment has.
    assert "kvsim: scenario dram-limited-nvme: Qwen3-32B on one H200" in captured.err
    assert ("kvsim: hardware one H200 running qwen3-32b; IO profile h200-ramdrive (fitted to "
            "tests/data/bench_h200_array.json); load policy always") in captured.err
    assert "warning" not in captured.err


def test_every_run_says_its_scenario_and_profile_and_warns_of_the_vm_disk(capsys):
    argv = ["trace", "replay", "--scenario", "vllm-pr-49644", "--contexts", "4", "--tier", "none", "--json"]
    assert main(argv + ["--hardware", "h200-disk"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["scenario"] == "vllm-pr-49644"
    assert "kvsim: scenario vllm-pr-49644: vLLM PR #49644's reload benchmark" in captured.err
    assert "kvsim: warning: IO profile h200-disk is the H200 VM's own virtual disk" in captured.err
    assert main(ARGS) == 0
    err = capsys.readouterr().err
    assert f"kvsim: trace {MINI}" in err and "kvsim: hardware one H200 running llama3-8b; IO profile h200-ramdrive" \
        in err and "warning" not in err


def test_table_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "out.png"
    assert main(ARGS + ["--plot", str(png)]) == 0
    captured = capsys.readouterr()
    assert "TTFT P99" in captured.out and "disk:32GiB" in captured.out
    assert f"kvsim: wrote {png}" in captured.err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_problems_are_found_before_the_simulation(capsys, tmp_path, monkeypatch):
    assert main(ARGS + ["--plot", str(tmp_path / "out")]) == 2
    assert "name a file ending in .png, .svg, .pdf" in capsys.readouterr().err
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib"
                        else real_find_spec(name, *a))
    assert main(ARGS + ["--plot", str(tmp_path / "out.png")]) == 2
    captured = capsys.readouterr()
    assert "--plot needs matplotlib" in captured.err and captured.out == ""


def test_generate_then_replay_the_file(capsys, tmp_path):
    trace = tmp_path / "reload.jsonl"
    assert main(["trace", "generate", "reload", "--contexts", "6", "-o", str(trace)]) == 0
    assert len(trace.read_text().splitlines()) == 12
    assert main(["trace", "replay", str(trace), "--tier", "cpu:8GiB", "--json"]) == 0
    tier = json.loads(capsys.readouterr().out)["tiers"][0]
    assert tier["requests"] == 12 and set(tier["phases"]) == {"fill", "reload"}


@pytest.mark.parametrize("argv, message", [
    (["--block-size", "0"], "argument --block-size: must be an integer in [1, 1000000000], got '0'"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: must be an integer in [1, 1000000000], got '0'"),
    (["--max-num-batched-tokens", "-3"], "argument --max-num-batched-tokens: must be an integer in [1, 1000000000]"),
    (["--kv-bytes-per-token", "x"], "argument --kv-bytes-per-token: expected an integer in [1, 1073741824], got 'x'"),
    (["--contexts", "0"], "argument --contexts: must be an integer in [1, 1000000000], got '0'"),
    (["--fill-rate", "0"], "argument --fill-rate: must be a rate in [1e-06, 1e+06] requests/s, got '0'"),
    (["--reload-rate", "nan"], "argument --reload-rate: must be a rate in [1e-06, 1e+06] requests/s, got 'nan'"),
    (["--gpu-kv", "lots"], "argument --gpu-kv: size='lots': expected an integer number of bytes"),
    (["--seed", "-1"], "argument --seed: must be an integer in [0, 18446744073709551615], got '-1'"),
    (["--tier", "disk:1TB:threads=0"], "threads='0' must be an integer >= 1"),
    ([MINI, "--time-scale", "0"], "argument --time-scale: must be a number > 0, got '0'"),
    ([MINI, "--sample", "1.5"], "argument --sample: must be a fraction in (0, 1], got '1.5'"),
    ([MINI, "--limit", "0"], "argument --limit: must be an integer in [1, 1000000000], got '0'"),
])
def test_every_numeric_flag_is_checked_in_one_line(capsys, argv, message):
    assert main(["trace", "replay", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, message", [
    (["--time-scale", "3"], "--time-scale: trace flags; without a TRACE scenario dram-limited-nvme replays its "
                            "reload workload"),
    (["--scenario", "llm-d-cpu-offload", "--time-scale", "2"],
     "--time-scale: trace flags; without a TRACE scenario llm-d-cpu-offload replays its own stages at the rates "
     "its source states"),
    (["--sample", "0.5", "--limit", "3"], "--sample, --limit: trace flags"),
    ([MINI, "--contexts", "8"], "--contexts: reload-scenario flags; they do nothing with a TRACE"),
    ([MINI, "--seed", "3"], "--seed: --seed only seeds --sample for a trace"),
    (["--tier", "none", "--load-policy", "always"], "--load-policy: no offload tier to load from"),
    (["--tier", "disk:1TB", "--host-free", "64GiB"],
     "--host-free: only page-cache tiers (disk:SIZE:pagecache) use free host memory"),
    ([MINI, "--scenario", "vllm-pr-49644"], "--scenario: reload-scenario flags; they do nothing with a TRACE"),
    (["--model", "llama3-70b"], "llama3-70b's weights (131.3 GiB) leave no KV cache on one H200 of 131.3 GiB; "
                                "give the replica's KV cache with --gpu-kv"),
    (["--hardware", "nope.json"], "--hardware 'nope.json': no such file, and not one of h200-disk, h200-array"),
])
def test_flags_that_would_do_nothing_are_refused(capsys, argv, message):
    assert main(["trace", "replay", *argv]) == 2
    assert f"kvsim: error: {message}" in capsys.readouterr().err


def test_bad_inputs_are_clear_errors(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n{oops\n')
    assert main(["trace", "replay", str(bad)]) == 2
    assert f"kvsim: error: {bad}:2: not JSON" in capsys.readouterr().err
    assert main(["trace", "replay", MINI, "--tier", "tape:1TB"]) == 2
    assert "use none, cpu:SIZE, disk:SIZE" in capsys.readouterr().err


def test_bad_input_files_name_the_file_and_line(capsys, tmp_path):
    """Issue 23: a non-UTF-8 trace named neither file nor line; a profile with a list for
    its seal rates was an AttributeError; a bench case without its detail a KeyError."""
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(Path(MINI).read_bytes().split(b"\n", 1)[0] + b"\n\xff\xfe\n")
    profile = tmp_path / "hw.json"
    doc = json.loads((Path(__file__).parents[1] / "kvsim" / "profiles" / "h200_disk.json").read_text())
    doc["seal_gib_s"] = [9.4, 44.0]
    profile.write_text(json.dumps(doc, indent=1))
    bench = tmp_path / "bench.json"
    doc = json.loads((Path(__file__).parent / "data" / "bench_h200_disk.json").read_text())
    del doc["cases"][0]["detail"]
    bench.write_text(json.dumps(doc, indent=1))
    for argv, where in ((["trace", "replay", str(trace)], f"{trace}:2: not UTF-8 text"),
                        (["trace", "replay", MINI, "--hardware", str(profile)], f"{profile}:"),
                        (["calibrate", str(bench)], f"{bench}:")):
        assert main(argv) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1, captured.err
        assert captured.err.startswith(f"kvsim: error: {where}"), captured.err


def test_hitrate_oracle_table_and_json(capsys):
    assert main(["trace", "hitrate", MINI, "--capacity", "8GiB", "--capacity", "1TB"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rates = [float(line.rsplit(" ", 1)[1]) for line in lines]
    assert 0 < rates[0] < rates[1] < 1
    assert main(["trace", "hitrate", MINI, "--capacity", "8GiB", "--capacity", "1TB", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    full = [c["token_hit_rate"] for c in doc["capacities"]]
    assert [round(r, 4) for r in full] == rates and full != rates  # full precision
    assert [c["bytes"] for c in doc["capacities"]] == [8 << 30, 10**12]


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("trace replay", "trace generate", "trace hitrate", "calibrate"):
        assert cmd in out


@pytest.mark.skipif(not REAL.exists(), reason="the shared Mooncake trace is not present")
def test_real_mooncake_trace_sampled(capsys):
    assert main(["trace", "replay", str(REAL), "--sample", "0.05", "--time-scale", "2",
                 "--tier", "none", "--tier", "disk:1TB", "--json"]) == 0
    none, disk = json.loads(capsys.readouterr().out)["tiers"]
    assert none["requests"] > 300
    assert disk["offload_hit_rate"] > 0
    assert disk["recomputed_tokens"] < none["recomputed_tokens"]


@pytest.mark.parametrize("argv,message", [
    (["trace", "replay", MINI, "--tirr", "disk:1TB"], "unrecognized arguments: --tirr (did you mean --tier?)"),
    (["trace", "replay", "--scenaro", "vllm-pr-49644"], "unrecognized arguments: --scenaro (did you mean --scenario?)"),
    (["trace", "replay", "--tier=disk:1TB", "--contxts", "4"], "unrecognized arguments: --contxts (did you mean "
                                                               "--contexts?)"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["trace", "--bogus", "replay"], "unrecognized arguments: --bogus"),
])
def test_a_mistyped_option_is_named_not_blamed_on_the_trace(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"kvsim: error: {message}\n"


@pytest.mark.parametrize("columns", [60, 100, 300])
def test_the_table_fits_the_width_and_continues_below(capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["trace", "replay", "--contexts", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= columns
    tables = sum(line.startswith("┏") for line in lines)
    # Seven tiers: one table side by side when wide, several below each other when not,
    # each with every row.
    assert (tables == 1) == (columns == 300)
    assert sum("reload TTFT P90" in line for line in lines) == tables


def test_the_main_job_warns_only_as_the_docs_explain(capsys):
    # docs/kvsim.md says the default replay prints no warning: queueing for the GPU is 40%
    # of the TTFT of none and cpu:8GiB, below kvsim's threshold of half, and 11% of
    # disk:100GiB's; any warning the run prints would go unexplained, and figures that
    # moved would make it wrong.
    docs = " ".join((Path(__file__).resolve().parents[1] / "docs" / "kvsim.md").read_text().split())
    assert "It prints no warning. Queueing for the GPU is 40% of the TTFT of `none` and `cpu:8GiB`" in docs
    assert "`disk:100GiB` queues for 11% of its TTFT, the 200 GiB tiers for under 2%" in docs
    assert main(["trace", "replay"]) == 0
    captured = capsys.readouterr()
    text = " ".join((captured.out + captured.err).split())
    assert "warning" not in text.lower()
    rows = re.findall(r"queueing share of TTFT ((?:│ *[\d.]+% *)+)│", text)  # the table continues below itself
    shares = [float(v) for row in rows for v in re.findall(r"([\d.]+)%", row)]
    assert len(shares) == 7 and [round(v) for v in shares[:3]] == [40, 40, 11]  # none, cpu:8GiB, disk:100GiB
    assert max(shares[3:]) < 2  # the four 200 GiB tiers: the docs' "under 2%"
    assert "kvsim: overloaded" not in text


@pytest.mark.parametrize("argv, message", [
    ([], "the following arguments are required: trace|calibrate"),
    (["trace"], "the following arguments are required: replay|generate|hitrate"),
])
def test_a_missing_command_names_the_commands(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"kvsim: error: {message}" in err and err.count("\n") == 1


def test_a_reader_that_leaves_early_is_not_an_error():
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-m", "kvsim", "trace", "generate", "reload"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    assert p.stdout.read(10)
    p.stdout.close()  # as `| head -c 10` does
    err = p.stderr.read()
    assert p.wait(timeout=60) in (0, 141) and err == b""


def test_shared_prefix_requests_are_inference_perfs_in_order(tmp_path, capsys):
    out = tmp_path / "sp.jsonl"
    assert main(["trace", "generate", "shared-prefix", "--groups", "3", "--prompts-per-group", "2", "--system-len",
                 "50000", "--question-len", "256", "--output-len", "9", "--requests", "8", "-o", str(out)]) == 0
    reqs = read_trace(str(out))
    assert len(reqs) == 8 and {r.arrival_ns for r in reqs} == {0}
    assert {(r.input_length, r.output_length, r.block_tokens) for r in reqs} == {(50256, 9, 16)}
    # Six prompts, each once before any repeats; a group's prompts share its 3,125 blocks of system prompt.
    assert len({r.hash_ids for r in reqs[:6]}) == 6 and reqs[6:] == reqs[:2]
    assert len({r.hash_ids[:3125] for r in reqs}) == 3
    for argv, message in [(["shared-prefix", "--system-len", "50001"], "both must be multiples of 16"),
                          (["reload", "--groups", "3"], "--groups: shared-prefix flags; they do nothing with reload"),
                          (["shared-prefix", "--contexts", "3"], "--contexts: reload-scenario flags")]:
        assert main(["trace", "generate", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


# -- issue 44 items 6 and 7: every number checked where it is parsed ------------------------


def test_a_concurrency_past_its_range_names_the_flag(tmp_path):
    # Issue 44 item 7: "Stop argument for islice() must be None or an integer", naming no flag.
    import subprocess
    import sys
    t = tmp_path / "t.jsonl"
    t.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n')
    r = subprocess.run([sys.executable, "-m", "kvsim", "trace", "replay", str(t), "--concurrency",
                        "99999999999999999999999"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr == ("kvsim: error: argument --concurrency: must be an integer in [1, 1000000000], got "
                        "'99999999999999999999999'\n")


@pytest.mark.parametrize("argv", [["trace", "replay", MINI, "--tier", "none"], ["trace", "replay", "--tier", "none"],
                                  ["trace", "hitrate", MINI, "--capacity", "8GiB"]])
def test_a_block_size_the_trace_blocks_do_not_divide_is_one_line(capsys, argv):
    # A ZeroDivisionError traceback when the block size exceeded the trace's 512-token blocks.
    assert main([*argv, "--block-size", "1024"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("kvsim: error: --block-size 1024: trace blocks of 512 tokens are not a multiple of "
                                 "the block size 1024\n")


def _numeric_flags(*command: str) -> list[str]:
    """Every flag of ``kvsim COMMAND`` that takes a number (a count, a size, a rate, ...)."""
    from kvoffload import cli_args
    from kvsim.cli import build_parser
    from tests.cli_flags import flag_table, subparser
    return sorted(f for f, check in flag_table(subparser(build_parser(), *command)).items()
                  if isinstance(check, (cli_args.Integer, cli_args.Number, cli_args.Size, cli_args.Amount)))


SP = ["--groups", "2", "--prompts-per-group", "2", "--system-len", "128", "--question-len", "128"]
# Where a numeric flag's refusal is tried (it comes first, at parsing); the values of the
# sweep that are a flag's own (0: no output, the whole prompt, the first seed; a seed is
# 64 bits), and runs that take them.
SWEEP = {("trace", "replay"): ["trace", "replay", MINI, "--tier", "none"],
         ("trace", "generate"): ["trace", "generate", "reload"],
         ("trace", "hitrate"): ["trace", "hitrate", MINI, "--capacity", "8GiB"],
         ("calibrate",): ["calibrate", "gpu"]}
LEGIT = {"--output-len": {"0"}, "--router-prefix-tokens": {"0"}, "--seed": {"0", str(2**63)}}
RUNS = {("trace", "replay", "--output-len"): [["trace", "replay", "--tier", "none", "--contexts", "2"]],
        ("trace", "replay", "--seed"): [["trace", "replay", "--tier", "none", "--contexts", "2"],
                                        ["trace", "replay", MINI, "--tier", "none", "--sample", "0.5"]],
        ("trace", "replay", "--router-prefix-tokens"): [["trace", "replay", MINI, "--tier", "none", "--replicas", "2",
                                                         "--limit", "20"]],
        ("trace", "generate", "--output-len"): [["trace", "generate", "reload", "--contexts", "2"],
                                                ["trace", "generate", "shared-prefix", *SP]],
        ("trace", "generate", "--seed"): [["trace", "generate", "reload", "--contexts", "2"],
                                          ["trace", "generate", "shared-prefix", *SP]],
        ("trace", "hitrate", "--seed"): [["trace", "hitrate", MINI, "--capacity", "8GiB", "--sample", "0.5"]]}
SWEPT = [(command, flag, value) for command in SWEEP for flag in _numeric_flags(*command)
         for value in (str(10**30), str(2**63), "-1", "nan", "inf", "1e400", "0")]


@pytest.mark.parametrize("command, flag, value", SWEPT, ids=[f"{' '.join(c)} {f} {v[:8]}" for c, f, v in SWEPT])
def test_every_numeric_flag_refuses_what_is_out_of_its_range_in_one_line(capsys, command, flag, value):
    # Every numeric flag of trace replay, trace generate, trace hitrate and calibrate gpu:
    # huge, negative, not finite, or 0 where 0 means nothing, is one line naming the flag,
    # exit 2, nothing on stdout; a value that is the flag's own runs.
    if value in LEGIT.get(flag, ()):
        for argv in RUNS[(*command, flag)]:
            assert main([*argv, flag, value]) == 0, capsys.readouterr().err
            capsys.readouterr()
        return
    assert main([*SWEEP[command], flag, value]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"kvsim: error: argument {flag}: ") and err.count("\n") == 1, err
    assert f"{value!r}" in err or value in err


def test_the_sweep_covers_every_numeric_flag():
    # What the issue lists, at least: the flags it names and a few more of each command.
    flags = {f for c in SWEEP for f in _numeric_flags(*c)}
    assert {"--concurrency", "--max-num-seqs", "--replicas", "--time-scale", "--seed", "--limit", "--block-size",
            "--contexts", "--prefix-len", "--fill-rate", "--groups", "--requests", "--system-len", "--depth",
            "--budget-s", "--allreduce", "--drives", "--gpu-kv", "--capacity", "--kv-bytes-per-token"} <= flags
    assert {f for _, f, _ in SWEPT} == flags


@pytest.mark.parametrize("weight", [str(10**30), "1e300", "-1", "nan", "inf", "0"])
def test_router_weights_past_their_range_are_one_line(capsys, weight):
    assert main(["trace", "replay", MINI, "--replicas", "2", "--router-weights", f"queue={weight}"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"kvsim: error: argument --router-weights: must be a weight in (0, 1e+06], got '{weight}'\n"


@pytest.mark.parametrize("argv, message", [
    (["--fill-rate", "1e-300"], "argument --fill-rate: must be a rate in [1e-06, 1e+06] requests/s, got '1e-300'"),
    (["--reload-rate", "1e300"], "argument --reload-rate: must be a rate in [1e-06, 1e+06] requests/s, got '1e300'"),
    (["--seed", str(2**64)], f"argument --seed: must be an integer in [0, {2**64 - 1}], got '{2**64}'"),
])
def test_rates_and_seeds_are_bounded_where_they_overflowed_or_wrapped(capsys, argv, message):
    # --fill-rate 1e-300 was an OverflowError traceback (a gap of 1e309 ns); a seed of
    # 2**64 sampled as seed 0 does (xxh64 takes it modulo 2**64).
    for command in (["trace", "replay", "--tier", "none"], ["trace", "generate", "reload"]):
        assert main([*command, "--contexts", "2", *argv]) == 2
        assert capsys.readouterr().err == f"kvsim: error: {message}\n"


# -- issue 45: sizes need their unit, a tier once, one convention of units, progress ------


@pytest.mark.parametrize("argv, message", [
    (["trace", "replay", "--tier", "disk:200"],
     "argument --tier: bad tier 'disk:200': size='200' has no unit: write it with one, e.g. disk:200GiB"),
    (["trace", "replay", "--tier", "cpu:8+disk:1TiB"], "bad tier 'cpu:8+disk:1TiB': size='8' has no unit: write it "
                                                      "with one, e.g. cpu:8GiB"),
    (["trace", "replay", "--tier", "disk:1TiB:unit=4194304"], "unit='4194304' has no unit: write it with one, e.g. "
                                                             "unit=8MiB"),
    (["trace", "replay", "--gpu-kv", "64"], "argument --gpu-kv: size '64' has no unit: write it with one, e.g. 64GiB"),
    (["trace", "replay", "--tier", "disk:1TiB:pagecache", "--host-free", "32"], "argument --host-free: size '32' has "
                                                                                "no unit"),
    (["trace", "hitrate", MINI, "--capacity", "100"], "argument --capacity: size '100' has no unit"),
])
def test_a_size_without_its_unit_is_refused_in_one_line(capsys, argv, message):
    # Issue 45: `--tier disk:200` replayed a 200-byte tier and said it was "smaller than one
    # unit of 32 4194304-byte slots and vLLM's null block".
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("kvsim: error: ") and err.count("\n") == 1, err
    assert message in err and "B for bytes)" in err and "smaller than one unit" not in err


def test_a_size_in_bytes_says_so_with_b():
    from kvsim.tiers import parse_tier
    assert parse_tier("disk:107374182400B", need_unit=True).capacity_bytes == 100 << 30
    assert parse_tier("disk:107374182400").capacity_bytes == 100 << 30  # kvoffload's config rule, in code


def test_a_size_without_its_unit_is_no_traceback_from_the_command_line():
    import subprocess
    import sys
    for argv in (["-m", "kvsim", "trace", "replay", "--tier", "disk:200"],
                 ["-m", "kvsim.restart", "--tier", "disk:200"]):
        r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
        assert "size='200' has no unit: write it with one, e.g. disk:200GiB" in r.stderr


@pytest.mark.parametrize("tiers, message", [
    (["disk:200GB", "disk:200GB"], "--tier disk:200GB given twice: each tier is replayed once, give it once"),
    (["none", "disk:200GB", "disk:0.2TB"], "--tier disk:0.2TB is the same tier as --tier disk:200GB"),
    (["disk:1TiB:threads=4:pagecache", "disk:1TiB:pagecache:threads=4"],
     "--tier disk:1TiB:pagecache:threads=4 is the same tier as --tier disk:1TiB:threads=4:pagecache"),
    (["cpu:8GiB+disk:1TiB", "cpu:8GiB+disk:1024GiB"], "--tier cpu:8GiB+disk:1024GiB is the same tier as "
                                                      "--tier cpu:8GiB+disk:1TiB"),
    (["none", "none"], "--tier none given twice"),
])
def test_a_tier_given_twice_is_refused_naming_it(capsys, tiers, message):
    # Issue 45: `--tier disk:200GB --tier disk:200GB` replayed the same tier twice, silently.
    assert main(["trace", "replay", *(f for t in tiers for f in ("--tier", t))]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"kvsim: error: {message}") and err.count("\n") == 1, err


def test_tiers_that_differ_are_replayed_each(capsys):
    assert main(["trace", "replay", "--contexts", "2", "--tier", "disk:200GB", "--tier", "disk:200GiB",
                 "--tier", "disk:200GB:pagecache", "--json"]) == 0
    assert [t["tier"] for t in json.loads(capsys.readouterr().out)["tiers"]] == [
        "disk:200GB", "disk:200GiB", "disk:200GB:pagecache"]


def test_the_restart_command_refuses_a_tier_given_twice(capsys):
    from kvsim.restart import main as restart
    assert restart(["--tier", "disk:1TiB", "--tier", "disk:1TiB"]) == 2
    assert capsys.readouterr().err == ("python -m kvsim.restart: error: --tier disk:1TiB given twice: each tier is "
                                       "replayed once, give it once\n")


def test_kvsims_own_sizes_are_in_one_convention_binary(capsys):
    # Issue 45: `vllm-disk:100GiB` and `disk:100GB` side by side. kvsim's scenarios and
    # defaults name sizes in GiB (vLLM's, kvoffload's and the sources' own units), and its
    # tables, titles and messages print GiB; a size typed stays as typed.
    from kvsim.cli import TRACE_TIERS
    from kvsim.scenarios import SCENARIOS
    labels = " ".join([t for sc in SCENARIOS.values() for t in sc.tiers] + list(TRACE_TIERS))
    units = re.findall(r"\d([KMGT]i?B)\b", labels)
    assert units and set(units) <= {"GiB", "TiB"}, labels
    for sc in SCENARIOS.values():
        assert not re.search(r"\d (KB|MB|GB|TB)\b", sc.summary), sc.summary
    assert main(["trace", "replay", "--contexts", "4", "--tier", "none", "--tier", "disk:200GB"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "GPU KV 53.9 GiB" in out and "disk:200GB" in out
    assert re.search(r"bytes stored │ 0 │ [\d.]+ GiB", out) and not re.search(r"\d (KB|MB|GB|TB)\b", out), out
    assert main(["trace", "hitrate", MINI, "--capacity", "8GiB", "--capacity", "1TB"]) == 0
    assert [line.split(":")[0] for line in capsys.readouterr().out.splitlines()] == ["8.0 GiB", "931.3 GiB"]


def _under_a_terminal(argv: list[str], stderr_tty: bool) -> tuple[int, bytes, bytes]:
    """``python -m kvsim ARGV`` with stdout a pipe and stderr a terminal (a pty) or a pipe."""
    import os
    import pty
    import subprocess
    import sys
    import threading
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE",
                                                             "COLUMNS", "LINES")}
    env["TERM"] = "xterm"
    if not stderr_tty:
        r = subprocess.run([sys.executable, "-m", "kvsim", *argv], capture_output=True, env=env, timeout=300)
        return r.returncode, r.stdout, r.stderr
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "kvsim", *argv], stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    chunks: list[bytes] = []

    def drain() -> None:  # the pty's buffer is small: read it while the child writes
        while True:
            try:
                b = os.read(master, 65536)
            except OSError:  # EIO once the child has closed it
                return
            if not b:
                return
            chunks.append(b)

    reader = threading.Thread(target=drain)
    reader.start()
    out = p.stdout.read()
    rc = p.wait(timeout=300)
    reader.join(timeout=60)
    os.close(master)
    return rc, out, b"".join(chunks)


@pytest.mark.parametrize("json_out", [False, True])
def test_a_replay_shows_progress_on_a_terminal_and_none_into_a_pipe(json_out):
    # Issue 45: long replays show progress on a terminal and stay quiet in a pipe. The bar
    # went to stdout (rich's default console), and not at all with --json: with stdout a
    # pipe, a terminal on stderr saw nothing move.
    argv = ["trace", "replay", MINI, "--tier", "none", "--tier", "disk:1TiB"] + (["--json"] if json_out else [])
    rc, out, err = _under_a_terminal(argv, stderr_tty=True)
    assert rc == 0 and b"\x1b" not in out, out[:300]
    assert b"\xe2\x94\x81" in err and b"disk:1TiB" in err and b"\x1b[2K" in err, err[:300]  # the bar, on stderr
    assert (json.loads(out)["tiers"] if json_out else b"TTFT P50" in out)
    rc, out, err = _under_a_terminal(argv, stderr_tty=False)
    assert rc == 0 and b"\x1b" not in out + err
    assert err.decode().splitlines() == [f"kvsim: trace {MINI}", "kvsim: hardware one H200 running llama3-8b; IO "
                                         "profile h200-ramdrive (fitted to tests/data/bench_h200_array.json); load "
                                         "policy faster"]


def test_every_command_the_docs_give_is_one_kvsim_accepts(monkeypatch):
    # docs/kvsim.md gives each table's command, or the flags it adds to a replay: each must
    # be one kvsim takes as written (sizes with their unit, flags that exist), not one it
    # refuses. The docs' examples of refusals are named here.
    import shlex
    from kvoffload import cli_args
    from kvsim.cli import build_parser
    from kvsim.restart import build_parser as restart_parser
    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    text = (root / "docs" / "kvsim.md").read_text()
    docs = " ".join(re.sub(r"```.*?```", " ", text, flags=re.S).split())  # inline code, not the blocks
    refused = {"--tier disk:200", "--gpu-kv 64"}
    placeholder = re.compile(r"\[|\.\.\.|\b(TRACE|SIZE|PROFILE|BENCH|NAME|SPEC|M|N|X|F)\b|F\.png|bench\.json"
                             r"|hw\.json| is ")
    runs = []
    for code in re.findall(r"`([^`]+)`", docs):
        if code.startswith("python -m kvsim"):
            argv = shlex.split(code)[2:]
            runs.append((code, restart_parser() if argv[0] == "kvsim.restart" else build_parser(), argv[1:]))
        elif code.startswith("--") and " " in code and code not in refused and not code.startswith(
                ("--check", "--drives", "--base")):
            runs.append((code, build_parser(), ["trace", "replay", *shlex.split(code)]))
    checked = 0
    for code, parser, argv in runs:
        if placeholder.search(code) or any(a.endswith(".jsonl") and not Path(a).exists() for a in argv
                                           if argv[:2] != ["trace", "generate"]):
            continue  # a trace the docs generate first, or the shared one where it is not
        try:
            parser.parse_args(argv)
        except (SystemExit, cli_args.UsageError) as e:
            raise AssertionError(f"docs/kvsim.md: `{code}` is refused: {e}") from None
        checked += 1
    assert checked >= 20, runs
