"""bench/mla_prefill_sweep.py without a GPU: config labels, the summary against the fastest
SDPA, and the worker loop that survives a variant crashing its process."""

from __future__ import annotations

import argparse
import sys
import textwrap

import pytest
from lanekv.kernels.prefill.config import MLA_PREFILL_VARIANTS, AttnLaunchConfig

from bench.mla_prefill_sweep import causal_flops, parse_config, run_jobs, summarize


def test_parse_config_reads_every_variant_label():
    for config in MLA_PREFILL_VARIANTS:
        assert parse_config(config.label) == config
    assert parse_config("64,32,4,3") == AttnLaunchConfig(64, 32, 4, 3)
    for bad, match in (("128,128,8", "want block_m"), ("128,128,8,x", "want block_m"),
                       ("128,128,8,2+tmaa", "unknown switch 'tmaa'")):
        with pytest.raises(argparse.ArgumentTypeError, match=match):
            parse_config(bad)


def test_causal_flops_count_qk_192_and_v_128():
    # one head, two tokens: 3 (query, key) pairs of 2 * (192 + 128) flops
    assert causal_flops(1, 2) == 3 * 2 * 320


def _row(n, kind, config, ms, form="v 128", ok=True):
    return {"tokens": n, "kind": kind, "config": config, "form": form, "ms": ms, "ok": ok,
            "tflops": 1.0 / ms}


def test_summary_takes_each_backends_fastest_form_and_ranks_only_correct_kernels():
    rows = [
        _row(8192, "sdpa", "cudnn", 5.0, "v 128"),
        _row(8192, "sdpa", "cudnn", 6.0, "v padded 192"),
        {"tokens": 8192, "kind": "sdpa", "config": "flash", "form": "v 128", "error": "RuntimeError: no"},
        _row(8192, "sdpa", "flash", 8.0, "v padded 192"),
        _row(8192, "kernel", "128,128,8,2", 5.5),
        _row(8192, "kernel", "128,128,8,2+tma", 4.0, ok=False),  # fast but wrong: ranks nowhere
        _row(8192, "kernel", "128,64,8,4+tma+overlap", 4.9),
        {"tokens": 8192, "kind": "kernel", "config": "128,128,8,2+tma+warp_specialize",
         "error": "worker process died (exit status 134)"},
        _row(32768, "sdpa", "cudnn", 80.0),
        _row(32768, "kernel", "128,128,8,2", 92.0),
    ]
    summary = summarize(rows)
    short, long = summary["8192"], summary["32768"]
    assert short["sdpa"]["cudnn"]["form"] == "v 128" and short["sdpa"]["flash"]["ms"] == 8.0
    assert short["best_sdpa"] == "cudnn (v 128)"
    assert short["best_kernel"] == "128,64,8,4+tma+overlap"
    assert short["best_vs_sdpa"] == pytest.approx(5.0 / 4.9) and short["meets_target"] is True
    assert rows[4]["vs_cudnn"] == pytest.approx(5.0 / 5.5) and rows[4]["vs_flash"] == pytest.approx(8.0 / 5.5)
    assert long["best_vs_sdpa"] == pytest.approx(80.0 / 92.0) and long["meets_target"] is False


FAKE_WORKER = textwrap.dedent("""
    import json, os, sys
    spec = json.loads(sys.argv[-1])
    with open(os.environ["LAUNCHES"], "a") as f:
        f.write("x")
    for n in spec["tokens"]:
        for job in spec["jobs"]:
            if [n, job] in spec["skip"]:
                continue
            print("START " + json.dumps([n, job]), flush=True)
            if job == "kernel:128,128,8,2+tma+warp_specialize":
                os._exit(134)  # a compiler abort takes the process with it
            if job == "kernel:128,64,8,3" and n == 8192:  # a fault: recorded, then the worker leaves
                print("ROW " + json.dumps({"tokens": n, "kind": "kernel", "config": job,
                                           "error": "illegal address"}), flush=True)
                os._exit(3)
            print("ROW " + json.dumps({"tokens": n, "kind": job.split(":")[0], "config": job,
                                       "ms": 1.0, "ok": True}), flush=True)
""")


def test_run_jobs_records_a_crashed_variant_and_finishes_the_rest(tmp_path, monkeypatch):
    script = tmp_path / "worker.py"
    script.write_text(FAKE_WORKER)
    launches = tmp_path / "launches"
    monkeypatch.setenv("LAUNCHES", str(launches))
    jobs = ["sdpa:cudnn", "kernel:128,128,8,2", "kernel:128,128,8,2+tma+warp_specialize",
            "kernel:128,64,8,3"]
    rows = run_jobs(jobs, [8192, 32768], 128, worker_argv=(sys.executable, str(script)))
    done = [(r["tokens"], r["config"]) for r in rows if "error" not in r]
    assert done == [(8192, "sdpa:cudnn"), (8192, "kernel:128,128,8,2"),
                    (32768, "sdpa:cudnn"), (32768, "kernel:128,128,8,2"), (32768, "kernel:128,64,8,3")]
    errors = [r for r in rows if "error" in r]
    assert errors == [
        {"tokens": 8192, "kind": "kernel", "config": "128,128,8,2+tma+warp_specialize",
         "form": "v 128", "error": "worker process died (exit status 134)"},
        {"tokens": 8192, "kind": "kernel", "config": "kernel:128,64,8,3", "error": "illegal address"},
    ]
    # a fresh worker after the crash and one after the fault; the crashed variant is not
    # tried again at 32k, the faulted one is
    assert launches.read_text() == "xxx"


def test_worker_dry_run_on_cpu(capsys):
    # The worker's own code path under the interpreter, float32, tiny sizes: each kernel
    # variant is checked against the reference and SDPA's output, and rows come out whole.
    import json

    from lanekv.kernels.backend import interpreter_enabled

    from bench.mla_prefill_sweep import worker

    if not interpreter_enabled():
        pytest.skip("the dry run launches the kernel on CPU tensors, which needs TRITON_INTERPRET=1")
    from bench.mla_prefill_sweep import PATH_JOB, PATH_LABEL

    jobs = ["sdpa:flash", "kernel:16,16,4,1", "kernel:32,16,4,1+tma+exp_bf16", PATH_JOB]
    spec = {"jobs": jobs, "tokens": [37], "heads": 2, "skip": [[37, "sdpa:flash"]],
            "device": "cpu", "dtype": "float32", "check_kv": [40, 23]}
    assert worker(spec) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(x[6:]) for x in lines if x.startswith("START ")] == [[37, j] for j in jobs[1:]]
    rows = [json.loads(x[4:]) for x in lines if x.startswith("ROW ")]
    assert [r["config"] for r in rows] == ["16,16,4,1", "32,16,4,1+tma+exp_bf16", PATH_LABEL]
    for r in rows:
        assert r["ok"] and r["ref_ok"] and "error" not in r, r
        assert r["ms"] > 0 and r["tflops"] == pytest.approx(causal_flops(2, 37) / r["ms"] / 1e9)
    assert rows[0]["rel_err"] < 1e-5 and rows[0]["ref_err"] < 1e-5  # float32 all the way
    assert 1e-5 < rows[1]["ref_err"] < 1e-2  # p rounded to bfloat16
    # the cuDNN path's CPU twin: float32, its split chunks merged by log-sum-exp
    assert rows[2]["rel_err"] < 1e-5 and rows[2]["ref_err"] < 1e-5 and rows[2]["ref_lse_err"] < 1e-4


HANGING_WORKER = textwrap.dedent("""
    import json, sys, time
    spec = json.loads(sys.argv[-1])
    for n in spec["tokens"]:
        for job in spec["jobs"]:
            if [n, job] in spec["skip"]:
                continue
            print("START " + json.dumps([n, job]), flush=True)
            if job == "kernel:128,128,8,2+tma+warp_specialize":
                time.sleep(60)  # a kernel that never finishes
            print("ROW " + json.dumps({"tokens": n, "kind": "kernel", "config": job, "ms": 1.0,
                                       "ok": True}), flush=True)
""")


def test_run_jobs_kills_a_hung_worker_and_saves_each_row(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(HANGING_WORKER)
    saved = []
    jobs = ["kernel:128,128,8,2+tma+warp_specialize", "kernel:128,64,8,3"]
    rows = run_jobs(jobs, [8192], 128, worker_argv=(sys.executable, str(script)), job_timeout_s=1.5,
                    on_row=lambda rows: saved.append(len(rows)))
    assert rows == [
        {"tokens": 8192, "kind": "kernel", "config": "128,128,8,2+tma+warp_specialize", "form": "v 128",
         "error": "no output for 2 s: worker killed"},
        {"tokens": 8192, "kind": "kernel", "config": "kernel:128,64,8,3", "ms": 1.0, "ok": True},
    ]
    assert saved == [1, 2]


COMPILING_WORKER = textwrap.dedent("""
    import json, sys, time
    spec = json.loads(sys.argv[-1])
    assert spec["precompile"] and spec["tokens"] == []
    for job in spec["jobs"]:
        assert job.startswith("kernel:")
        if job == "kernel:64,64,4,2":
            time.sleep(60)  # a compile that never ends
        if job == "kernel:128,64,4,3":
            time.sleep(0.5)  # the first worker is still busy when the second one hangs
        print("COMPILED " + json.dumps({"config": job[7:], "s": 0.1}), flush=True)
""")


def test_precompile_shares_the_kernel_jobs_and_kills_a_slow_worker(tmp_path):
    from bench.mla_prefill_sweep import precompile

    script = tmp_path / "worker.py"
    script.write_text(COMPILING_WORKER)
    jobs = ["sdpa:cudnn", "kernel:128,128,8,2", "kernel:64,64,4,2", "kernel:128,64,4,3",
            "kernel:128,128,4,2+tma+warp_specialize"]
    records = precompile(jobs, 128, 2, 3.0, worker_argv=(sys.executable, str(script)))
    # shares [0, 2] and [1, 3] of the kernel jobs: the second worker hangs on its first
    # job and is killed at the deadline; the first worker's records come back
    assert sorted(r["config"] for r in records) == ["128,128,8,2", "128,64,4,3"]


def test_worker_precompile_dry_run_on_cpu(capsys):
    import json

    from lanekv.kernels.backend import interpreter_enabled

    from bench.mla_prefill_sweep import worker

    if not interpreter_enabled():
        pytest.skip("the dry run launches the kernel on CPU tensors, which needs TRITON_INTERPRET=1")
    jobs = ["sdpa:flash", "kernel:32,16,4,1+tma+warp_specialize", "kernel:16,16,4,1+tma+overlap"]
    spec = {"jobs": jobs, "tokens": [], "heads": 2, "skip": [], "precompile": True,
            "precompile_tokens": 40, "device": "cpu", "dtype": "float32", "check_kv": [40, 23]}
    assert worker(spec) == 0
    lines = capsys.readouterr().out.splitlines()
    records = [json.loads(x[9:]) for x in lines if x.startswith("COMPILED ")]
    assert [r["config"] for r in records] == ["32,16,4,1+tma+warp_specialize", "16,16,4,1+tma+overlap"]
    for r in records:
        assert r["ref_ok"] and "error" not in r and r["ref_err"] < 1e-5, r


def test_failed_compiles_are_not_timed():
    from bench.mla_prefill_sweep import drop_failed_compiles

    jobs = ["sdpa:cudnn", "kernel:128,128,8,2", "kernel:128,64,4,3+tma+warp_specialize",
            "kernel:128,128,4,2+tma+warp_specialize", "kernel:64,64,4,2"]
    records = [{"config": "128,128,8,2", "ref_ok": True, "ref_err": 2e-3},
               {"config": "128,64,4,3+tma+warp_specialize", "ref_ok": False, "ref_err": 0.7},
               {"config": "64,64,4,2", "error": "OutOfResources: shared memory"}]
    keep, refused = drop_failed_compiles(jobs, records, [8192, 32768])
    assert keep == ["sdpa:cudnn", "kernel:128,128,8,2"]
    why = {(r["tokens"], r["config"]): r["error"] for r in refused}
    assert len(why) == 6 and all(r["kind"] == "kernel" and "ms" not in r for r in refused)
    assert why[(8192, "128,64,4,3+tma+warp_specialize")].startswith("precompile: wrong on the reference")
    assert why[(32768, "128,128,4,2+tma+warp_specialize")] == "precompile: no result from the parallel compile"
    assert why[(8192, "64,64,4,2")] == "precompile: OutOfResources: shared memory"
    summary = summarize(refused)  # error rows rank nowhere
    assert summary["8192"]["best_kernel"] is None
