"""``python -m fastattn``: JSON alone on stdout with --json -, progress and table on stderr, a summary line, plain
--help, exit status 1 when a case disagrees; ``warmup``: its units, options, and a small run that warms a cache."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from fastattn import __main__ as cli
from fastattn import jobs
from fastattn.jobs import checks, warmup

#: The cheapest op group: two small kernels to compile.
CHEAP_OPS = "set_rows"
#: An elapsed time as the progress writes it: "12.3 s", or "1:05" from a minute on.
ELAPSED = r"(\d+\.\d s|\d+:\d\d)"


def _run(*args, cache_dir=None, timeout=600) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = str(cache_dir)
    return subprocess.run([sys.executable, "-m", "fastattn", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


@pytest.fixture(scope="module")
def json_run(tmp_path_factory):
    """One run of the cheap group, compiling into an empty Numba cache (so its first calls compile)."""
    return _run("--ops", CHEAP_OPS, "--threads", "1", "--budget", "0.01", "--json", "-",
                cache_dir=tmp_path_factory.mktemp("numba_cache"))


def test_json_dash_writes_only_json_to_stdout(json_run):
    assert json_run.returncode == 0, json_run.stderr
    report = json.loads(json_run.stdout)  # the whole of stdout is one JSON document
    for field in ("fastattn", "numba", "numpy", "cpu", "cores", "numba_threads", "threads", "tolerances",
                  "budget_s", "reference_budget_s", "rounds", "load_average", "summary", "warnings", "results"):
        assert field in report, field
    assert report["reference_budget_s"] == report["budget_s"] / 2
    assert report["threads"] == [1]
    assert report["tolerances"]["set_rows"]  # every case's tolerance, in words
    assert {r["op"] for r in report["results"]} == {"set_rows"}
    for r in report["results"]:
        assert r["ok"] and r["threads"] == 1
        assert r["fast_min_ms"] <= r["fast_ms"] and r["reference_min_ms"] <= r["reference_ms"]
    assert report["results"][0]["compiled"]  # an empty cache: the first call compiled (later cases share kernels)
    assert report["summary"]["line"] == f"{len(report['results'])}/{len(report['results'])} agree with the reference"


def test_progress_table_legend_and_summary_go_to_stderr(json_run):
    err = json_run.stderr
    assert re.search(r"^\[1/3\] +\d+\.\d s  set_rows .*1 thread$", err, re.M), err
    assert re.search(r"^\[3/3\] ", err, re.M)
    assert re.search(r"^ +compiling rows\.\S+ for ", err, re.M)  # the compiling marker
    assert re.search(r"^op +shape +path +thr +max err +ok +ref ms min / med +fast ms min / med", err, re.M)
    assert "speed-up  reference median / fast median" in err  # the legend
    assert re.search(r"^3/3 agree with the reference$", err, re.M)
    assert "fastattn: compiling" not in err  # the notices show as progress, not as loose lines


def test_the_cases_cover_every_public_op_dtype_and_rope_mode():
    """Every function of fastattn.__all__ but the thread settings has a case, and so has every storage dtype and
    every RoPE mode; the checks are the reference comparisons the job runs (an op added to fastattn.__all__
    without a case fails here)."""
    import fastattn

    cases = jobs.build(jobs.select_ops(None))
    assert set(jobs.public_ops()) == {
        "rms_norm", "rms_norm_mul", "add_rms_norm_mul", "set_rows", "flash_attn_ext", "rope_ext", "rope_cache",
        "apply_rope_cache", "rope_set_rows", "apply_rope_cache_set_rows", "quantize", "dequantize"}
    assert set(jobs.public_ops()) <= set(fastattn.__all__)
    assert jobs.coverage(cases) == {"ops": [], "dtypes": [], "modes": []}
    assert {c.op for c in cases} == set(jobs.public_ops())  # no case under another name
    assert all(c.check is not None or c.skip for c in cases)
    dropped = [c for c in cases if c.mode != "VISION" and c.dtype != "q4_0"]
    assert jobs.coverage(dropped) == {"ops": [], "dtypes": ["q4_0"], "modes": ["VISION"]}


def test_list_prints_every_case_without_running_it(tmp_path):
    run = _run("--list", cache_dir=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "compiling" not in run.stderr and not list(tmp_path.rglob("*.nbi"))  # nothing ran, nothing compiled
    out = run.stdout
    assert out.startswith("op groups (--ops): norm, set_rows, rope, attention, quant\n")
    assert re.search(r"^group +op +dtype +mode +shape +path$", out, re.M)
    for group, op, dtype, mode in (("norm", "rms_norm", "float32", "-"), ("set_rows", "set_rows", "bfloat16", "-"),
                                   ("rope", "rope_ext", "float32", "IMROPE"),
                                   ("rope", "apply_rope_cache_set_rows", "float16", "NEOX"),
                                   ("attention", "flash_attn_ext", "q8_0", "-"), ("quant", "dequantize", "q4_0", "-")):
        assert re.search(rf"^{group} +{op} +{dtype} +{mode} ", out, re.M), (op, dtype, mode)
    assert out.rstrip().endswith("every public op, storage dtype and RoPE mode is covered")
    only = _run("--list", "--ops", "quant")
    assert re.search(r"^4 cases: 2 ops; dtypes q8_0, q4_0; RoPE modes none$", only.stdout, re.M), only.stdout
    assert "not covered by these groups: ops rms_norm, " in only.stdout
    assert "; modes NORMAL, NEOX, MROPE, VISION, IMROPE" in only.stdout


def test_bfloat16_without_ml_dtypes_is_skipped_with_the_reason():
    """ml_dtypes is optional (not in the base install): without it the bfloat16 case is reported as skipped, with
    the reason, and the job still exits 0."""
    code = ("import sys\n"
            "sys.modules['ml_dtypes'] = None  # import ml_dtypes now raises ImportError\n"
            "from fastattn.__main__ import main\n"
            "sys.exit(main(['--ops', 'set_rows', '--threads', '1', '--budget', '0.01', '--rounds', '2', "
            "'--json', '-']))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    reason = "bfloat16 needs ml_dtypes (python -m pip install ml_dtypes)"
    assert re.search(r"^set_rows +1 x 1024 f32 -> bf16 \(4096, 1024\) +decode +1 +skipped +" + re.escape(reason),
                     run.stderr, re.M), run.stderr
    assert re.search(rf"^2/2 agree with the reference; 1 skipped \({re.escape(reason)}\)$", run.stderr, re.M)
    report = json.loads(run.stdout)
    skipped = [r for r in report["results"] if r["skipped"]]
    assert [(r["dtype"], r["ok"], r["skipped"]) for r in skipped] == [("bfloat16", None, reason)]
    assert report["summary"]["skipped"] == 1 and report["summary"]["agree"] == report["summary"]["cases"] == 2
    assert not any("slower than" in w for w in report["warnings"])  # a skipped case has no timing to warn about


def test_without_json_the_table_and_summary_go_to_stdout(tmp_path):
    run = _run("--ops", CHEAP_OPS, "--threads", "1", "--budget", "0.01", "--rounds", "2")
    assert run.returncode == 0, run.stderr
    assert re.search(r"^set_rows +512 x 1024", run.stdout, re.M)
    assert re.search(r"^3/3 agree with the reference$", run.stdout, re.M)
    assert "2 rounds per figure" in run.stdout
    assert "[1/3]" in run.stderr and "[1/3]" not in run.stdout


def test_help_is_plain_text():
    run = _run("--help")
    assert run.returncode == 0
    assert "``" not in run.stdout and "`" not in run.stdout and ":func:" not in run.stdout
    for word in ("check", "bench", "warmup", "--json", "--dtypes", "Exit status"):
        assert word in run.stdout


# ---------------------------------------------------------------------------------------------------------------
# In-process: the exit status and the warnings, on a NumPy-only op group (nothing to compile).
def _numpy_cases(config, rng, *, wrong: bool):
    x = rng.standard_normal(1000).astype(np.float32)
    naive = (x * np.float32(3)).astype(np.float32)

    def fast():
        return x * np.float32(3) + (np.float32(1e-3) if wrong else np.float32(0))

    return [jobs.Case("triple", "(1000,) f32", "numpy", fast=fast, reference=lambda: x.astype(np.float64) * 3,
                      check=checks.float32_rule(naive, 1e-6), nbytes=8000)]


def test_a_round_slowed_after_the_sizing_call_ends_early():
    """Calls that turn slow after the call that sized the rounds (a busy machine) cannot stretch the timing: each
    round stops at twice its share of the budget, and its figure is the mean of the calls it made."""
    import time

    from fastattn.jobs.timing import time_rounds

    made = []

    def call():
        made.append(1)
        time.sleep(0.01)  # 10 ms, where the sizing call said 10 µs: 5000 calls per round planned

    start = time.perf_counter()
    timing = time_rounds(call, budget_s=0.1, rounds=2, once_s=1e-5)
    assert timing.calls == 5000
    assert time.perf_counter() - start < 0.5  # about 2 x 0.1 s; the planned rounds would take 100 s
    assert timing.min_ms >= 10 and len(made) < 40
    quick = time_rounds(lambda: None, budget_s=0.01, rounds=2)  # unslowed: every planned call is made
    assert quick.calls >= 1


def test_paired_rounds_rotate_their_order_and_time_only_the_calls():
    """The benchmarks' side-by-side timing: each round starts one name later, the arguments are made outside the
    call's time, and the medians leave out the warm-up rounds."""
    import time

    from fastattn.jobs.timing import Rounds, per_second

    order = []

    def call(name):
        def record(*args):
            order.append((name, args))
            time.sleep(0.002 if name == "b" else 0)
        return record

    calls = {name: call(name) for name in "abc"}
    timed = Rounds(calls)

    def slow_arguments():
        time.sleep(0.005)
        return (1,)

    for _ in range(4):
        timed.run(calls, slow_arguments)
    assert [name for name, _ in order] == list("abc" "bca" "cab" "abc")
    assert all(args == (1,) for _, args in order)
    medians = timed.medians(skip=1)
    assert all(len(seconds) == 4 for seconds in timed.seconds.values())
    assert medians["b"] >= 0.002 and medians["a"] < 0.002  # the 5 ms of making the arguments are not counted
    assert Rounds(["x"]).rotated() == ["x"]
    assert per_second(3e9, 1.5) == 2.0


def test_the_benchmark_tables_write_times_with_their_unit_and_rows_as_markdown():
    """bench/report.py's and bench/compile_times.py's cells and tables, written by the main job's report module."""
    from fastattn.jobs.report import aligned, duration, markdown

    assert [duration(s) for s in (2.07e-6, 3.586e-4, 1.0951e-3, 1.1744e-2, 0.2659, None)] == [
        "2.07 µs", "358.6 µs", "1.095 ms", "11.74 ms", "265.9 ms", "—"]
    assert markdown(["a", "b"], [("1", "")]) == "| a | b |\n| --- | --- |\n| 1 |  |"
    assert markdown(["a"]) == "| a |\n| --- |"
    assert aligned([("op", "ms"), ("rope_ext", "1.0")]) == ["op        ms", "--------  ---", "rope_ext  1.0"]


def test_checks_refuse_a_result_of_another_shape():
    """A result that only broadcasts against the reference (a case that returned the wrong array) fails."""
    row = np.ones((1, 4), np.float32)
    rows = np.ones((3, 4), np.float32)
    assert checks.float32_rule(row, 1e-6)(row, row.astype(np.float64)).ok
    assert not checks.float32_rule(row, 1e-6)(rows, rows.astype(np.float64)).ok
    assert not checks.half_1ulp()(rows.astype(np.float16), row.astype(np.float64)).ok
    assert not checks.bit_exact()(rows, row).ok


@pytest.mark.parametrize("wrong, status", [(False, 0), (True, 1)])
def test_exit_status_is_1_when_a_case_disagrees(monkeypatch, capsys, wrong, status):
    monkeypatch.setitem(jobs._BUILDERS, "numpy_only",
                        lambda config, rng: _numpy_cases(config, rng, wrong=wrong))
    assert cli.main(["--ops", "numpy_only", "--threads", "1", "--budget", "0.001", "--rounds", "2"]) == status
    out = capsys.readouterr().out
    if wrong:
        assert "0/1 agree with the reference; outside the tolerance: triple (1000,) f32 numpy (1 thr)" in out
    else:
        assert "1/1 agree with the reference" in out


def test_busy_machine_and_slow_fast_paths_are_warned_about():
    from fastattn.jobs import machine, report

    assert machine.busy_warning(1.5, 2) is None
    assert "load average 3.5 on 2 core(s)" in machine.busy_warning(3.5, 2)
    base = dict(op="rms_norm_mul", shape="(512, 4096) f32", path="prefill", max_error=0.0, bound=1.0, ok=True,
                tolerance="", reference_ms=1.0, first_call_ms=1.0, rate=1.0, rate_unit="GB/s")
    one = jobs.Result(threads=1, fast_ms=0.5, fast_min_ms=0.5, speedup=2.0, **base)
    two = jobs.Result(threads=2, fast_ms=3.0, fast_min_ms=1.0, speedup=0.33, **base)
    found = report.warnings([one, two], [])
    assert any("2 threads took 3.000 ms, 1 thread 0.5000 ms" in w for w in found)
    assert any("slower than the float64 NumPy reference: rms_norm_mul (512, 4096) f32 prefill (2 thr): 0.33x" in w
               for w in found)
    assert any(w.startswith("noisy timings") for w in found)
    assert report.warnings([one], []) == []


@pytest.mark.parametrize("argv", [["--dtypes", "float32"], ["--jobs", "0"], ["warmup", "--json", "-"],
                                  ["check", "--plot", "x.png"], ["--ops", "nope"], ["--threads", "0"],
                                  ["--budget", "-1"], ["warmup", "--ops", "nope"], ["warmup", "--dtypes", "int8"]])
def test_bad_arguments_exit_with_status_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# warmup
def test_warmup_units_cover_every_group_and_dtype():
    units = warmup.units(None, ["float32", "float16"])
    assert [u.label for u in units] == [
        "attention prefill float32", "attention prefill float16", "attention decode float32",
        "attention decode float16", "rope float32", "rope float16", "norm float32", "norm float16",
        "set_rows float32", "set_rows float16"]
    assert warmup.units(["rope"], ["float16"]) == [warmup.Unit("rope", "float16")]
    assert {u.dtype for u in warmup.units(["set_rows"])} == set(warmup.DEFAULT_DTYPES)
    assert "q8_0" in warmup.DEFAULT_DTYPES
    # the norms take no quantized input: no unit of theirs for a quantized type
    assert {u.dtype for u in warmup.units(["norm"])} == set(warmup.DEFAULT_DTYPES) - {"q8_0"}
    assert warmup.units(["norm", "set_rows"], ["q4_0"]) == [warmup.Unit("set_rows", "q4_0")]
    # quantize / dequantize are warmed by the set_rows units, once however many groups ask for them
    assert warmup.units(["quant", "set_rows"], ["q4_0"]) == [warmup.Unit("set_rows", "q4_0")]
    with pytest.raises(ValueError, match="ops: unknown"):
        warmup.units(["nope"], ["float32"])
    with pytest.raises(ValueError, match="dtypes: expected float32, float16, bfloat16, q8_0 or q4_0, got 'int8'"):
        warmup.units(None, ["int8"])


def test_warmup_compiles_into_the_cache_and_a_new_process_finds_it(tmp_path):
    run = _run("warmup", "--ops", CHEAP_OPS, "--dtypes", "float32,q8_0", "--threads", "1", cache_dir=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout == ""
    for unit in ("set_rows float32", "set_rows q8_0"):
        assert re.search(rf"^\[[12]/2\] \[[#.]+\] {unit} +{ELAPSED}  \(\d+ kernel\(s\) compiled\)$", run.stderr,
                         re.M), run.stderr
    assert re.search(rf"^warm-up done in {ELAPSED}: \d+ kernel\(s\) compiled", run.stderr, re.M)
    assert list(tmp_path.rglob("*.nbi"))
    # a new process: the first calls of set_rows (as the main job makes them) load from the cache
    code = ("import numpy as np, fastattn\n"
            "fastattn.set_num_threads(1)  # as warmed\n"
            "cache = np.zeros((1024, 1024), np.float32)\n"
            "q8 = fastattn.quantize(np.zeros((1024, 1024), np.float32), 'q8_0')\n"
            "for rows in (1, 512):\n"
            "    fastattn.set_rows(cache, np.ones((rows, 1024), np.float32), np.arange(rows))\n"
            "    fastattn.set_rows(q8, np.ones((rows, 1024), np.float32), np.arange(rows))\n")
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                           env=dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path)))
    assert first.returncode == 0, first.stderr
    assert "fastattn: compiling" not in first.stderr, first.stderr


def test_progress_on_a_terminal_rewrites_one_line_with_the_compiling_marker():
    import io

    from fastattn.jobs.progress import Progress, elapsed

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    progress = Progress(stream)
    progress.case(3, 12, "rope_ext (512,32,128) f32, neox, 2 threads")
    progress.compiling("start", "rope.drivers.drive_fused for float32", None)
    progress.compiling("end", "rope.drivers.drive_fused for float32", 6.25)
    progress.finish()
    text = stream.getvalue()
    assert "\n" not in text  # one status line, rewritten in place
    assert re.search(r"\r\x1b\[K\[ 3/12\] +\d+\.\d s  rope_ext \(512,32,128\) f32, neox, 2 threads"
                     r"  \[compiling rope\.drivers\.drive_fused for float32 \.\.\.\]", text)
    assert "[compiled rope.drivers.drive_fused for float32 in 6.2 s]" in text
    assert text.endswith("\r\x1b[K")
    assert (elapsed(12.34), elapsed(125)) == ("12.3 s", "2:05")


def test_the_plot_judges_each_rate_against_its_own_roof(tmp_path):
    """bench --plot: a GB/s rate whose working set fits the last-level cache is drawn against a copy of its size
    (its data stays in cache between the timing's calls, so it may exceed DRAM bandwidth), a larger one against
    the DRAM copy, one too small for threads against the one-thread in-cache copy, GFLOP/s against the FMA peak;
    the legend says which is which."""
    pytest.importorskip("matplotlib")
    from fastattn.jobs import plot, roofs

    def result(rate, unit, ms):
        return jobs.Result(op="op", shape="s", path="p", threads=2, max_error=0.0, bound=None, ok=True,
                           tolerance="", reference_ms=1.0, fast_ms=ms, first_call_ms=1.0, speedup=1.0, rate=rate,
                           rate_unit=unit)

    measured = roofs.Roofs(2, copy_gbs=20.0, read_gbs=25.0, fma_gflops=300.0, cache_copy_gbs=70.0,
                           cache_bytes=8 << 20, serial_copy_gbs=40.0, serial_bytes=1 << 20,
                           last_level_cache_bytes=32 << 20)
    in_cache = result(45.0, "GB/s", 0.37)  # 16.7 MB per call
    in_dram = result(15.0, "GB/s", 100.0)  # 1.5 GB per call
    flops = result(148.0, "GFLOP/s", 14.0)
    assert plot.working_set(in_cache) == pytest.approx(45e9 * 0.37e-3)
    assert plot.roof_for(in_cache, measured) == (70.0, "in-cache copy")  # no copy of its size measured
    sized = roofs.Roofs(**{**measured.__dict__, "copy_at": {roofs.size_class(45e9 * 0.37e-3): 55.0}})
    assert roofs.size_class(45e9 * 0.37e-3) == 16 << 20 and roofs.size_class(10) == roofs.SERIAL_BYTES
    assert plot.roof_for(in_cache, sized) == (55.0, "copy of 16 MiB")  # the copy of its own working set
    assert plot.roof_for(in_dram, measured) == (20.0, "DRAM copy")
    assert plot.roof_for(flops, measured) == (300.0, "FMA peak")
    serial = result(30.0, "GB/s", 0.0016)  # 48 KB: below the parallel size, run on one thread
    serial.extra["parallel"] = False
    assert plot.roof_for(serial, measured) == (40.0, "1-thread in-cache copy")
    unknown = roofs.Roofs(2, 20.0, 25.0, 300.0, 70.0, 8 << 20, 40.0, 1 << 20, None)  # no cache size: the copy's
    assert plot.roof_for(in_cache, unknown) == (20.0, "DRAM copy")
    assert plot.roof_for(result(45.0, "GB/s", 0.1), unknown) == (70.0, "in-cache copy")
    skipped = jobs.Result(op="set_rows", shape="s", path="p", threads=2, max_error=0.0, bound=None, ok=None,
                          tolerance="", reference_ms=0.0, fast_ms=0.0, first_call_ms=0.0, speedup=0.0, rate=0.0,
                          rate_unit="", skipped="bfloat16 needs ml_dtypes")
    path = tmp_path / "roofs.png"
    plot.plot([in_cache, in_dram, flops, serial, skipped], {2: sized}, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
