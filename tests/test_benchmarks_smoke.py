"""The benchmark scripts keep working: each runs with --smoke (tiny shapes on the CPU) in CI."""

import importlib
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _smoke(script: str, out: Path, *extra: str, env: dict | None = None) -> tuple[dict, str]:
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--out", str(out), *extra],
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text()), run.stdout


def _benchmark_module(name: str):
    """The module benchmarks/<name>.py, imported as the scripts import each other (from their folder)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_bench_rollout_smoke(tmp_path):
    """Every path runs patched and unpatched, V1 and V2 with n = 0 and 20 top logprobs, the kept set and the
    draw with top-k and top-p each alone and both; every patched row's outputs pass the benchmark's check
    (scored with the fused kernels under Triton's interpreter, the path that reported V2 n > 0 wrong when the
    check passed vLLM's strided token column), and the unpatched rows are the control: vLLM's own bits fail
    the same check on some rows."""
    report, stdout = _smoke("bench_rollout.py", tmp_path / "rollout.json")
    rows = report["rows"]
    assert report["backend"] == "fused" and report["not_run"] == {}
    assert all(r["wall_ms"] > 0 and r["host_ms"] > 0 for r in rows)
    settings = {r["setting"] for r in rows}
    for setting in settings:  # every setting timed unpatched and patched, at every batch size
        assert {(r["patched"], r["batch"]) for r in rows if r["setting"] == setting} == {
            (patched, batch) for patched in (False, True) for batch in (1, 4)}, setting
    for path in ("v1_sampler", "v2_worker"):
        assert {r["num_logprobs"] for r in rows if r["path"] == path} == {0, 20}
        assert any(r["path"] == path and r["top_k"] == 50 for r in rows)
    for path in ("kept_set", "draw"):
        assert {(r["top_k"], r["top_p"]) for r in rows if r["path"] == path} == {(50, 0.9), (50, None), (None, 0.9)}
    patched = [r for r in rows if r["patched"]]
    checks = {"kept_set": "kept_set_equals_contract", "draw": "draw_in_kept_set"}
    for r in patched:
        assert r[checks.get(r["path"], "first_column_equals_rl_logp")] is True, r
        assert r["path"] != "kept_set" or r["kernel_equals_contract"] is True, r
        assert r["path"] != "v1_sampler" or r["ranks_equal_count"] is True, r
    control = [r for r in rows if not r["patched"] and r["path"] not in checks]
    assert any(not r["first_column_equals_rl_logp"] for r in control if r["path"] == "v1_sampler")
    assert any(not r["first_column_equals_rl_logp"] for r in control if r["path"] == "v2_worker")
    assert f"patched rows whose outputs are rl-logp's: {len(patched)}/{len(patched)}" in stdout
    assert not list(tmp_path.glob("*.partial")) and "report written" in stdout


def test_bench_rollout_says_which_paths_the_latest_vllm_lacks(tmp_path):
    """Against the latest vLLM release's sources (scripts/setup.sh unpacks them; V2 only: no V1 sampler, and
    no native draw to compare the patched one with): the paths it lacks are reported as not run, each with
    its reason, instead of failing the run (its V2 worker runs on the GPU: `h200_rollout_vllm_0.34.0*.json`;
    on the CPU vLLM's own top-k / top-p of that release has no path)."""
    latest = re.search(r"^VLLM_LATEST=(\S+)", (ROOT / "scripts" / "vllm_latest.sh").read_text(), re.M).group(1)
    sources = ROOT / f".vllm-{latest}"
    assert (sources / "vllm" / "_version.py").is_file(), f"{sources}: run scripts/setup.sh"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(sources), os.environ.get("PYTHONPATH")]))}
    report, stdout = _smoke("bench_rollout.py", tmp_path / "rollout.json", "--paths", "v1_sampler", "draw", env=env)
    assert report["vllm"] == latest and report["rows"] == []
    assert report["not_run"] == {
        "v1_sampler": f"vllm {latest} has no vllm.v1.sample.sampler",
        "draw": f"vllm {latest}'s vllm.v1.sample.ops.topk_topp_sampler has no random_sample (V1's draw without "
                "FlashInfer)",
    }
    assert "report written" in stdout


def test_bench_rollout_driver_side_smoke(tmp_path):
    """--driver times a third side in the same rounds, the patched step with the plans launched through the
    driver (on the CPU the interpreter's launch: the scopes, rows and checks are what is exercised): a
    '<setting> [driver]' row per setting and batch, compared to the unpatched one, its outputs rl-logp's.
    --match keeps the settings whose name it finds (here the V1 ones without top logprobs, and the kept
    set's)."""
    report, stdout = _smoke("bench_rollout.py", tmp_path / "rollout.json", "--driver", "--paths", "v1_sampler",
                            "kept_set", "--dtypes", "bfloat16", "--match", "n=0 |fp32")
    rows = report["rows"]
    assert {r["path"] for r in rows} == {"v1_sampler", "kept_set"}
    assert {r["num_logprobs"] for r in rows if r["path"] == "v1_sampler"} == {0}
    base = {(r["setting"], r["batch"]) for r in rows if not r["patched"]}
    driver = [r for r in rows if r.get("driver")]
    assert {(r["compared_to"], r["batch"]) for r in driver} == base
    assert all(r["setting"] == r["compared_to"] + " [driver]" and r["patched"] for r in driver)
    checks = {"kept_set": "kept_set_equals_contract"}
    assert all(r[checks.get(r["path"], "first_column_equals_rl_logp")] is True for r in driver)
    assert f"patched rows whose outputs are rl-logp's: {2 * len(base)}/{2 * len(base)}" in stdout


def test_bench_rollout_refuses_a_forward_without_cuda(tmp_path):
    """--behind-forward-ms queues a GPU kernel before each step: on the CPU it is refused by name, nothing
    is run or written."""
    out = tmp_path / "rollout.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_rollout.py"), "--smoke",
                          "--behind-forward-ms", "2", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 2 and "--behind-forward-ms 2.0 needs CUDA" in run.stderr and not out.exists()


def test_bench_rollout_check_fails_on_one_ulp():
    """The benchmark's checks, called on a V1 step's real outputs: the first column's and the ranks' true
    as they are; the first column's false when one sampled token's logprob is one ulp off, the ranks'
    false when one rank is one off."""
    bench_rollout = _benchmark_module("bench_rollout")
    setting = bench_rollout.Setting("v1_sampler", "raw_logprobs", 20, "bfloat16", 1.0)
    with bench_rollout.adapter.patched(backend="chunked"):
        step = bench_rollout.Step(setting, 6, 1031, torch.device("cpu"), "chunked")
        with torch.compiler.set_stance("force_eager"):
            ids, logprobs, ranks = step()
            assert step.check((ids, logprobs, ranks)) == {"first_column_equals_rl_logp": True, "ranks_equal_count": True}
            off = logprobs.clone()
            off[3, 0] = torch.nextafter(off[3, 0], torch.tensor(0.0))
            assert not bench_rollout.first_column_matches(step, ids, off)
            ranks[2] += 1
            assert step.check((ids, logprobs, ranks))["ranks_equal_count"] is False


def test_bench_rollout_replay_comparison_takes_v1s_outputs():
    """The CUDA-graph check's comparison, on a V1 step's real outputs (ids, logprobs, 1-D ranks): two steps
    that drew different tokens agree but for column 0 and the ranks; a top-n logprob one ulp off does not;
    other paths compare every output whole."""
    bench_rollout = _benchmark_module("bench_rollout")
    setting = bench_rollout.Setting("v1_sampler", "raw_logprobs", 5, "float32", 1.0)
    with bench_rollout.adapter.patched(backend="chunked"):
        step = bench_rollout.Step(setting, 4, 1031, torch.device("cpu"), "chunked")
        with torch.compiler.set_stance("force_eager"):
            step.reset()
            first = [t.clone() for t in step()]
            step.reset()
            second = [t.clone() for t in step()]
    second[0][:, 0] = (first[0][:, 0] + 1) % 1031  # another draw: its tokens, logprobs and ranks differ
    second[1][:, 0] = -1.0
    second[2] += 1
    assert bench_rollout.replay_same_as_eager("v1_sampler", second, first)
    second[1][2, 3] = torch.nextafter(second[1][2, 3], torch.tensor(0.0))
    assert not bench_rollout.replay_same_as_eager("v1_sampler", second, first)
    assert bench_rollout.replay_same_as_eager("v2_worker", first, [t.clone() for t in first])
    assert not bench_rollout.replay_same_as_eager("v2_worker", second[:2], first[:2])


def test_bench_logp_smoke(tmp_path):
    report, stdout = _smoke("bench_logp.py", tmp_path / "logp.json")
    main = [r for r in report["results"] if r["suite"] != "rollout"]
    assert not [r for r in main if "error" in r and "not importable" not in r["error"]]
    suites = {(r["suite"], r["provider"]) for r in main if "error" not in r}
    for suite in ("logp", "logp T=0.7", "entropy", "entropy T=0.7", "logp+entropy", "logp+entropy T=0.7"):
        assert (suite, "rl_logp") in suites
    # verl is installed here: its own functions are among the providers
    assert ("logp T=0.7", "verl logprobs_from_logits") in suites
    assert ("entropy", "verl entropy_from_logits (compiled)") in suites
    # the invariant providers are batch-invariant even in the smoke run
    invariant = [r for r in main if r["provider"] in ("rl_logp", "rl_logp chunked")]
    assert invariant and all(r["batch_mismatch_rows_of_64"] == 0 for r in invariant)
    rollout = [r for r in report["results"] if r["suite"] == "rollout"]
    assert {r["provider"] for r in rollout} == {
        "rl_logp", "torch log_softmax+gather", "rl_logp.column_logprobs K=21", "torch log_softmax+gather K=21",
        "rl_logp.full_logprobs", "torch log_softmax fp32"}
    assert all(r["wall_us"] > 0 and r["host_us"] > 0 for r in rollout)
    assert "x flr" in stdout


def test_bench_logp_sweep_smoke(tmp_path):
    out = tmp_path / "sweep.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_logp.py"), "--smoke", "--suites", "sweep",
                          "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 2 and not [r for r in rows if "error" in r]
    assert all(r[f"{kind}_{case}_ms"] > 0 for r in rows for kind in ("forward", "backward")
               for case in ("t1", "t07", "t1_entropy"))


def test_bench_verl_step_smoke(tmp_path):
    report, stdout = _smoke("bench_verl_step.py", tmp_path / "verl_step.json")
    steps = [r for r in report["results"] if r["suite"] == "fsdp step"]
    assert not [r for r in steps if "error" in r]
    assert sorted((r["temperature"], r["entropy"], r["mode"]) for r in steps) == sorted(
        (t, e, m) for t in (1.0, 0.7) for e in (False, True) for m in ("unpatched", "patched")
    )
    for r in steps:  # each patched row says how far it is from verl's own outputs on the same logits
        if r["mode"] == "patched":
            keys = {"logp_max_abs_diff", "grad_max_abs_diff"} | ({"entropy_max_abs_diff"} if r["entropy"] else set())
            assert keys <= set(r) and all(r[k] < 0.1 for k in keys), r  # verl rounds in bf16; a wrong T is nats off
    compiled = [r for r in report["results"] if r["suite"] == "compile"]
    assert {r["provider"] for r in compiled} == {"verl entropy_from_logits (torch)", "rl_logp.entropy", "rl_logp.logprobs"}
    for r in compiled:
        if r["provider"].startswith("rl_logp"):
            assert r["compiled_vs_eager_mismatches"] == 0 and r["graphs_so_far"] == 1, r
    # the Megatron step runs on the CPU too (tests/test_megatron_bench.py checks its rows)
    assert not [r for r in report["results"] if "note" in r or "error" in r]
    assert report["stubbed_modules"] == []  # everything verl imports is installed here
    assert "f+b ms" in stdout


def test_bench_linear_smoke(tmp_path):
    """Every provider that runs on the CPU gives a row at each setting; rl-logp's distance from itself is 0
    and verl's fused head's at T = 0.7 is not (it divides bf16 logits by the temperature)."""
    report, stdout = _smoke("bench_linear.py", tmp_path / "linear.json")
    rows = report["results"]
    assert not [r for r in rows if "error" in r]
    assert report["not_run"] == {"verl linear_cross_entropy (triton)": "needs a CUDA GPU"}
    settings = {(r["temperature"], r["entropy"]) for r in rows}
    assert settings == {(t, e) for t in (1.0, 0.7) for e in (False, True)}
    for t, e in settings:
        assert {r["provider"] for r in rows if (r["temperature"], r["entropy"]) == (t, e)} == {
            "rl_logp linear_logprobs", "verl FusedLinearForPPO (torch)", "torch lm_head + rl_logp"}
    assert all(r["fwd_bwd_ms"] > 0 for r in rows)
    ours = [r for r in rows if r["provider"] == "rl_logp linear_logprobs"]
    assert all(r["logp_max_abs_diff_vs_rl_logp"] == 0 and r["entropy_max_abs_diff_vs_rl_logp"] in (0, None) for r in ours)
    assert any(r["logp_max_abs_diff_vs_rl_logp"] > 0 for r in rows
               if r["provider"].startswith("verl") and r["temperature"] == 0.7)
    assert "report written" in stdout


def test_profile_rollout_step_isolates_the_scoring_call():
    """The host profile of a V1 step times its five sides and the two scoring calls alone, and the stretches
    of the step between the Sampler's methods on both sides (on the CPU no plan launches through the
    driver, so there is no "launch" mark); its third side is
    the patched step with rl-logp's scoring calls answered by torch's log_softmax: inside it the adapter is
    applied and `rl_logp.full_logprobs` / `column_logprobs` give log_softmax's values; its fourth by an
    fp32 output of their shape; in its fifth the plans' bound launches launch nothing; leaving each
    restores what it replaced and removes the patch."""
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_rollout_step.py"), "--device", "cpu",
                          "--vocab", "1031", "--batch", "4", "--steps", "6", "--rounds", "2", "--top", "3"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    sides, _, rest = run.stdout.partition("host us of each stretch")
    timed = re.findall(r"^  (.+?) +(\d+\.\d) +(\d+\.\d)$", sides, re.M)
    assert [name for name, *_ in timed] == ["unpatched", "patched", "patched, torch scores", "patched, empty scores",
                                            "patched, no launch", "rl_logp.full_logprobs alone",
                                            "torch log_softmax alone"], run.stdout
    assert all(float(a) > 0 and float(b) > 0 for _, a, b in timed)
    stretches = re.findall(r"^  (start|\w+[<>]) -> (\w+[<>]|end) +(\d+\.\d) +(\d+\.\d) +(\d+\.\d) +(\d+\.\d)$",
                           rest, re.M)
    marks = ["start", "compute_logprobs>", "compute_logprobs<", "sample>", "sample<", "gather_logprobs>",
             "gather_logprobs<", "end"]
    assert [(a, b) for a, b, *_ in stretches] == list(itertools.pairwise(marks)), run.stdout
    profile = _benchmark_module("profile_rollout_step")
    import rl_logp
    from rl_logp.integrations import vllm as adapter

    full, columns = rl_logp.full_logprobs, rl_logp.column_logprobs
    x = torch.randn(3, 1031)
    ids = torch.tensor([[0, 5], [7, 1030], [2, 2]])
    with profile.side_scope("patched, torch scores", "auto"):
        assert adapter.active_patches()
        assert torch.equal(rl_logp.full_logprobs(x), x.log_softmax(dim=-1))
        assert torch.equal(rl_logp.column_logprobs(x, ids), x.log_softmax(dim=-1).gather(-1, ids))
    assert rl_logp.full_logprobs is full and rl_logp.column_logprobs is columns and not adapter.active_patches()
    with profile.side_scope("patched, empty scores", "auto"):
        got = rl_logp.column_logprobs(x, ids)
        assert adapter.active_patches() and got.shape == ids.shape and got.dtype == torch.float32
        assert rl_logp.full_logprobs(x).shape == x.shape
    assert rl_logp.full_logprobs is full and rl_logp.column_logprobs is columns and not adapter.active_patches()
    from rl_logp.kernels import cluster_launch, launcher

    bound = (cluster_launch.ClusterLaunch.__call__, launcher.BoundLaunch.__call__)
    with profile.side_scope("patched, no launch", "auto"):
        assert adapter.active_patches() and rl_logp.full_logprobs is full
        assert cluster_launch.ClusterLaunch.__call__(None, [x]) and launcher.BoundLaunch.__call__(None, [x])
    assert (cluster_launch.ClusterLaunch.__call__, launcher.BoundLaunch.__call__) == bound
    with profile.side_scope("patched", "auto"):
        assert rl_logp.full_logprobs is full and adapter.active_patches()


def test_ncu_cases_smoke():
    """Every case of the Nsight Compute driver runs on the CPU at a tiny shape (the trainer cases under
    Triton's interpreter, the kept set by its torch reference), and a trainer case forward alone, and says
    what it ran."""
    ncu_cases = _benchmark_module("ncu_cases")
    runs = [(case, []) for case in [*ncu_cases.CASES, *ncu_cases.KEPT_CASES]] + [("t07_entropy", ["--forward-only"])]
    for case, extra in runs:
        run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ncu_cases.py"), "--case", case, "--rows", "3",
                              "--vocab", "1031", "--warmup", "1", *extra], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-4000:]
        assert run.stdout.startswith(f"{case}: 3 x 1031, ") and run.stdout.rstrip().endswith(" ran"), run.stdout
        if case in ncu_cases.CASES:
            assert run.stdout.rstrip().endswith("forward ran" if extra else "forward and backward ran"), run.stdout


def test_ncu_sass_summary_groups_a_kernels_instructions_and_stalls(tmp_path):
    """From a SASS CSV as ncu writes it (two kernels; thousands separators), the summary reads the named
    kernel only: its totals, each stall reason's share, the loop (instructions sharing a run count) apart
    from the once-per-row stretch, and the instructions with the most samples first."""
    columns = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
               "Instructions Executed", "stall_barrier", "stall_math", "stall_barrier (Not Issued)"]
    rows = [["Kernel Name", "other_kernel"], columns, ["0x10", "FADD R1, R2, R3", "999", "0", "5", "999", "0", "0"],
            ["Kernel Name", "cluster_row_stats"], columns,
            ["0x7f0000005200", "BAR.SYNC", "60", "60", "100", "60", "0", "60"],
            ["0x7f0000005210", "FFMA R1, R2, R3, R4", "30", "1", "1,000", "0", "30", "0"],
            ["0x7f0000005220", "MUFU.EX2 R5, R6", "10", "1", "1,000", "0", "10", "0"]]
    csv_path = tmp_path / "ncu_sass.csv"
    csv_path.write_text("\n".join(",".join(f'"{cell}"' for cell in row) for row in rows) + "\n")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ncu_sass_summary.py"), str(csv_path), "--top", "2"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "3 SASS instructions, 2100 warp instructions executed, 100 stall samples" in out
    assert "barrier 60.0%, math 40.0%" in out
    groups = re.findall(r"^\s+(\d+)\s+(\d+)\s+([\d.]+)%\s+([\d.]+)%$", out, re.MULTILINE)
    assert groups == [("1000", "2", "95.2", "40.0"), ("100", "1", "4.8", "60.0")]
    top = re.findall(r"^\s+(5\d\d0) (\S+)", out, re.MULTILINE)
    assert top == [("5200", "BAR.SYNC"), ("5210", "FFMA")]
