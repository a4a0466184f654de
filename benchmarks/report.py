"""Turn the results tree into target verdicts, ``results.md`` and ``results.png``.

Targets (from the benchmark issue), each reported as met / not met / n/a - never tuned away:

* blocking: nebula ``save_async`` blocking time (call + stall before the next optimizer step)
  <= 1% of ``torch.save``'s on CPU, <= 0.1% on GPU;
* persist bandwidth: state bytes / time-to-durable of nebula (local tier only) >= 85% of the
  sequential write + fsync bandwidth measured in the same run;
* throughput: overhead <= 3% with a checkpoint every 10 steps on the default workload (124m),
  and lower than every other system's;
* restore: nebula local-tier restore no slower than ``torch.load`` + ``load_state_dict`` of the
  same state (warm, and cold where the page cache could be emptied);
* staging memory: nebula ``stats()["staging_bytes"]`` <= 1.1x the state bytes, and host memory
  flat across 100 saves of a small state (RSS growth after the first 10 saves <= 8 MiB).
* multi-rank (``--ranks``, computed in :mod:`~.ranks`): nebula blocking per rank <= 2x the
  single-process figure; time to commit falling as ranks share the replicated bytes; ahead of
  ``dcp.async_save`` (blocking, time to commit, overhead) on every row.
* recovery (``--recovery``, computed in :mod:`~.recovery`), per state size: restart from nebula's
  memory tier to the first optimizer step <= 0.5x the better of ``torch.load`` and
  ``torch.load(mmap=True)``; its extra peak RSS <= 1.1x the state; local-root restore, warm and
  cold, no slower than ``torch.load``; the first two saves' stall <= 1.2x the later saves';
  a save's stall <= 1.2x one copy of the state into pre-touched buffers.
"""

from __future__ import annotations

from typing import Any, Optional

from benchmarks import rank_report, recovery_report
from benchmarks.common import fmt_b, fmt_pct, fmt_s, target
from benchmarks.limits import COLD_RESIDENT_MAX

DEFAULT_WORKLOAD = "124m"

METHOD = (
    "Blocking = `save()` call + the stall before the next `optimizer.step()` after one forward/backward "
    "(the time the training thread loses). Time to durable runs from the start of `save()` until the "
    "files and their directory are fsynced, while the next training step runs / with the training thread "
    "idle (blocking systems: the same). Persist GB/s = state bytes / idle time to durable. Overhead: "
    "interleaved rounds of K training steps with one save, each between two K-step segments without "
    "(its baseline is their mean), the former including what is left of the save's persist after the K "
    "steps (backlog); time with / time without - 1. The snapshot floor is the same measurement for a bare "
    "copy of the state into host memory (no I/O): the least any asynchronous checkpointer costs. Restore is "
    "into the existing model and optimizer: right after the save (with the share of the files the save "
    "left in the page cache), warm (second read) and cold (files evicted). Peak RSS Δ is over the RSS "
    "before the system's first save, during the saves / during the first restore. Written / save is "
    "block-device bytes from /proc/self/io (tmpfs not included; the memory tier's size is shown as shm).")
FLAT_RSS_SLACK = 8 << 20


def _med(res: dict[str, Any], key: str) -> Optional[float]:
    v = res.get(key)
    return v.get("median") if isinstance(v, dict) else None


def _ok(w: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in w.get("systems", []) if s.get("status") == "ok"}


# --------------------------------------------------------------------------- targets

def _blocking_target(ok: dict[str, dict[str, Any]], name: str, limit_block: float) -> dict[str, Any]:
    """Nebula's blocking time as a fraction of torch.save's on one workload."""
    neb, ts = ok.get("nebula") or ok.get("nebula_local"), ok.get("torch_save")
    nb, tb = _med(neb or {}, "blocking_s"), _med(ts or {}, "blocking_s")
    if neb and nb is not None and tb:
        r = nb / tb
        return target("blocking", f"{neb['name']} blocking <= {limit_block:.1%} of torch.save",
                       r <= limit_block, f"{r:.2%} ({fmt_s(nb)} vs {fmt_s(tb)})",
                       f"<= {limit_block:.1%}", name,
                       f"p95: {fmt_s(neb['blocking_s']['p95'])}; save_async call alone: "
                       f"{fmt_s(_med(neb, 'call_s'))}, stall before the next optimizer step: "
                       f"{fmt_s(_med(neb, 'stall_s'))}")
    return target("blocking", "nebula blocking <= 1% of torch.save", None,
                   "n/a", f"<= {limit_block:.1%}", name, "nebula or torch_save did not run")


def _persist_bw_target(ok: dict[str, dict[str, Any]], name: str, seq: dict[str, Any]) -> dict[str, Any]:
    """nebula_local's idle persist bandwidth against the measured sequential write limit."""
    nl = ok.get("nebula_local")
    if nl and seq.get("gbps"):
        idle = nl.get("persist_idle_gbps", nl["persist_gbps"])
        r = idle / seq["gbps"]
        return target("persist_bw", "nebula_local persist bandwidth >= 85% of seq write+fsync",
                       r >= 0.85, f"{r:.0%} ({idle:.2f} vs {seq['gbps']:.2f} GB/s)",
                       ">= 85%", name, "state bytes / median time to durable with the training "
                       "thread idle, as the limit is measured (while a training step runs: "
                       f"{nl['persist_gbps']:.2f} GB/s = {nl['persist_gbps'] / seq['gbps']:.0%}); "
                       "the limit is the best of its samples "
                       + ", ".join(f"{g:.2f}" for g in seq["samples_gbps"]))
    return target("persist_bw", "nebula_local persist bandwidth >= 85% of seq write+fsync",
                   None, "n/a", ">= 85%", name,
                   "nebula_local did not run" if not nl else "no write limit measured")


#: a tier's restore may take at most this many times the restore floor (read + checksum + copy)
FLOOR_RATIO = 1.5


def _cold_measured(s: dict[str, Any]) -> bool:
    return s.get("restore_cold_s") is not None and (s.get("cold_resident_fraction") or 0) < COLD_RESIDENT_MAX


def _restore_target(ok: dict[str, dict[str, Any]], w: dict[str, Any], name: str, system: str) -> dict[str, Any]:
    """``system``'s restore, warm and (where measurable) cold, against torch.load + load_state_dict
    and against FLOOR_RATIO x the restore floor of the same run."""
    what = f"{system} restore no slower than torch.load and <= {FLOOR_RATIO}x the floor of where its bytes lie"
    nl, ts = ok.get(system), ok.get("torch_save")
    tmpfs = system == "nebula"  # the memory tier: its pages are in tmpfs, never evicted (its cold restore is warm)
    floor = (w.get("restore_floor_tmpfs") if tmpfs else None) or w.get("restore_floor") or {}
    if not (nl and ts):
        return target("restore", what, None, "n/a", "<= torch.load + load_state_dict", name,
                      f"{system} or torch_save did not run")
    verdicts = [nl["restore_warm_s"] <= ts["restore_warm_s"]]
    val = f"warm {fmt_s(nl['restore_warm_s'])} vs {fmt_s(ts['restore_warm_s'])}"
    cold = _cold_measured(nl) and _cold_measured(ts)
    if cold:
        verdicts.append(nl["restore_cold_s"] <= ts["restore_cold_s"])
        val += f"; cold {fmt_s(nl['restore_cold_s'])} vs {fmt_s(ts['restore_cold_s'])}"
    details = [f"cold: {nl.get('cold_method')}" + (" (the memory tier is in tmpfs: read warm)" if tmpfs else "")
               if cold else "cold not measured"]
    if "warm_s" in floor:
        verdicts.append(nl["restore_warm_s"] <= FLOOR_RATIO * floor["warm_s"])
        ratios = f"warm {nl['restore_warm_s'] / floor['warm_s']:.2f}x"
        if cold and not tmpfs and floor.get("cold_s"):
            verdicts.append(nl["restore_cold_s"] <= FLOOR_RATIO * floor["cold_s"])
            ratios += f", cold {nl['restore_cold_s'] / floor['cold_s']:.2f}x"
        val += f"; floor {ratios}"
    else:
        details.append("floor not measured")
    return target("restore", what, all(verdicts), val,
                  f"<= torch.load + load_state_dict, <= {FLOOR_RATIO}x floor", name, "; ".join(details))


def _staging_target(ok: dict[str, dict[str, Any]], w: dict[str, Any]) -> dict[str, Any]:
    """The largest staging buffer a nebula system reported, against the state bytes."""
    name = w["name"]
    st = [s for s in (ok.get("nebula"), ok.get("nebula_local")) if s]
    reported = [(s["name"], (s.get("stats") or {}).get("staging_bytes")) for s in st]
    staging = [(n, b) for n, b in reported if isinstance(b, (int, float))]
    if not staging:
        return target("staging", "staging host memory <= 1.1x state bytes", None, "n/a",
                       "<= 1.10x", name, "ck.stats()['staging_bytes'] not available")
    n, b = max(staging, key=lambda x: x[1])
    r = b / w["state_bytes"]
    mem = [(s["name"], (s.get("stats") or {}).get("memory_tier_slot_bytes")) for s in st]
    detail = "; ".join(f"{sn}: the memory tier's own checkpoint is {fmt_b(mb)} of slot files "
                       "in /dev/shm (its storage, not staging)" for sn, mb in mem if mb)
    return target("staging", "staging host memory <= 1.1x state bytes", r <= 1.1,
                   f"{r:.2f}x ({fmt_b(b)}, {n})", "<= 1.10x", name, detail)


def _workload_targets(w: dict[str, Any], limit_block: float, seq: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-workload targets (blocking, persist bandwidth, restore, staging), in that order."""
    ok = _ok(w)
    name = w["name"]
    return [_blocking_target(ok, name, limit_block), _persist_bw_target(ok, name, seq),
            _restore_target(ok, w, name, "nebula_local"), _restore_target(ok, w, name, "nebula"),
            _staging_target(ok, w)]


def _throughput_notes(chosen: dict[str, Any], neb: dict[str, Any], others: dict[str, float]) -> list[str]:
    """The caveats and context printed next to the throughput verdict."""
    th = neb["throughput"]
    iv = th["interval"]
    notes = []
    if chosen["name"] != DEFAULT_WORKLOAD:
        notes.append(f"measured on {chosen['name']}, not the default workload {DEFAULT_WORKLOAD}")
    if iv != 10:
        notes.append(f"measured with a checkpoint every {iv} steps, not 10")
    if th.get("tiers_dropped"):
        notes.append(f"{th['tiers_dropped']} tier write(s) were dropped "
                     "because the tier was still busy")
    if th.get("backlog_s"):
        notes.append(f"includes {fmt_s(th['backlog_s'])} of persist backlog over {th['saves']} saves "
                     f"(without it {fmt_pct(th.get('overhead_excl_backlog'))})")
    own = [r["without_s"] for r in th.get("rounds", [])]
    if len(own) > 1:
        spread = (max(own) - min(own)) / (sum(own) / len(own))
        notes.append(f"noise: {neb['name']}'s own {iv}-step no-checkpoint segments spread "
                     f"{spread:.1%}; all systems' segments vary by {chosen.get('baseline_cv', 0):.0%} (CV)")
    else:
        notes.append(f"noise: the {iv}-step no-checkpoint segments vary by "
                     f"{chosen.get('baseline_cv', 0):.1%} (CV)")
    rounds = [r["overhead"] for r in th.get("rounds", []) if "overhead" in r]
    if rounds:
        notes.append("per round: " + ", ".join(fmt_pct(r) for r in rounds))
    floor = (chosen.get("snapshot_floor") or {}).get("overhead")
    if floor is not None:
        notes.append(f"snapshot floor (bare copy, no I/O) {fmt_pct(floor)}")
    if others:
        best = min(others, key=lambda p: others[p])
        notes.append(f"best peer: {best} {fmt_pct(others[best])}")
    return notes


def _throughput_target(workloads: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Nebula's training-throughput overhead on the default workload (else the first that ran)."""
    chosen = next((w for w in workloads if w["name"] == DEFAULT_WORKLOAD), workloads[0] if workloads else None)
    if chosen is None:
        return None
    ok = _ok(chosen)
    neb = ok.get("nebula") or ok.get("nebula_local")
    if not neb:
        return target("throughput", "nebula throughput overhead <= 3% and lowest", None, "n/a",
                       "<= 3%", chosen["name"], "nebula did not run")
    ov = neb["throughput"]["overhead"]
    others = {n: s["throughput"]["overhead"] for n, s in ok.items()
              if n not in ("nebula", "nebula_local")}
    lower = all(ov < o for o in others.values())
    return target("throughput", f"{neb['name']} throughput overhead <= 3% and lowest",
                   ov <= 0.03 and lower, fmt_pct(ov), "<= 3% and < every peer",
                   chosen["name"], "; ".join(_throughput_notes(chosen, neb, others)))


def _flat_target(results: dict[str, Any]) -> dict[str, Any]:
    """Host memory (RSS and staging) flat across many saves of a small state."""
    flat = results.get("memory_flatness")
    if not flat or "error" in flat:
        return target("flat", "host memory flat across 100 saves", None, "n/a", "", None,
                       (flat or {}).get("error", "not run"))
    g = flat["rss_growth_bytes"]
    s0, s1 = flat.get("staging_after_warmup"), flat.get("staging_after_last")
    staging_flat = s0 is None or s0 == s1
    return target("flat", f"host memory flat across {flat['saves']} saves", g <= FLAT_RSS_SLACK
                   and staging_flat, f"RSS {fmt_b(g)} after save {flat['after_warmup_save']}; "
                   f"staging {fmt_b(s0)} -> {fmt_b(s1)}", f"RSS growth <= {fmt_b(FLAT_RSS_SLACK)}, "
                   "staging unchanged", None, f"state {fmt_b(flat['state_bytes'])}, nebula default tiers")


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Compute every target's verdict from the results tree (``met`` is None for n/a)."""
    out: list[dict[str, Any]] = []
    gpu = results.get("device", "cpu").startswith("cuda")
    limit_block = 0.001 if gpu else 0.01
    seq = (results.get("limits") or {}).get("seq_write_fsync") or {}
    workloads = [w for w in results.get("workloads", []) if w.get("status") == "ok"]

    for w in workloads:
        out.extend(_workload_targets(w, limit_block, seq))
    throughput = _throughput_target(workloads)
    if throughput is not None:
        out.append(throughput)
    st = results.get("settings", {})
    if not (st.get("ranks_only") or st.get("recovery_only")):
        out.append(_flat_target(results))
    out.extend(rank_report.evaluate_targets(results))
    out.extend(recovery_report.evaluate_targets(results))
    return out


# --------------------------------------------------------------------------- markdown

def _status(s: dict[str, Any]) -> str:
    if s.get("status") != "ok":
        return f"{s.get('status')}: {s.get('reason')}"
    bad = [k for k in ("restore_ok", "restore_warm_ok", "restore_cold_ok", "restore_step_ok")
           if s.get(k) is False]
    notes = []
    if bad:
        notes.append("RESTORE MISMATCH (" + ", ".join(bad) + ")")
    th = s.get("throughput") or {}
    if th.get("tiers_dropped"):
        notes.append(f"{th['tiers_dropped']} tier write(s) dropped in the throughput loop")
    if th.get("backlog_s") and th["backlog_s"] > 0.05 * th.get("with_ckpt_s", 0):
        notes.append(f"persist outlasted {th['interval']} steps: {fmt_s(th['backlog_s'] / th['saves'])} "
                     "backlog per save (counted in overhead)")
    if th.get("saves_skipped"):
        notes.append(f"{th['saves_skipped']} save(s) skipped")
    return "; ".join(notes) or "ok"


def _after_save(s: dict[str, Any]) -> str:
    frac = s.get("after_save_resident_fraction")
    cached = f" ({frac:.0%} cached)" if frac is not None else ""
    return fmt_s(s.get("restore_after_save_s")) + cached


def _cold(s: dict[str, Any]) -> str:
    frac = s.get("cold_resident_fraction")
    if frac is not None and frac >= COLD_RESIDENT_MAX:
        return f"n/a ({frac:.0%} stayed cached)"
    return fmt_s(s.get("restore_cold_s"))


def workload_table(w: dict[str, Any]) -> str:
    """The markdown table of one workload."""
    iv = None
    rows = ["| system | blocking median | blocking p95 | save call | time to durable (training / idle) "
            "| persist GB/s (idle) | overhead | restore after save | restore warm | restore cold "
            "| peak RSS Δ save / restore | written / save | status |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in w.get("systems", []):
        if s.get("status") != "ok":
            rows.append(f"| {s['name']} |" + " n/a |" * 11 + f" {_status(s)} |")
            continue
        th = s["throughput"]
        iv = th["interval"]
        written = s.get("bytes_written_per_save")
        shm = s.get("shm_bytes")
        wtxt = fmt_b(written) + (f" + {fmt_b(shm)} shm" if shm else "")
        idle = _med(s, "durable_idle_s")
        rows.append(
            f"| {s['name']} | {fmt_s(_med(s, 'blocking_s'))} | {fmt_s(s['blocking_s']['p95'])} "
            f"| {fmt_s(_med(s, 'call_s'))} | {fmt_s(_med(s, 'durable_s'))} / {fmt_s(idle)} "
            f"| {s.get('persist_idle_gbps', s['persist_gbps']):.2f} "
            f"| {fmt_pct(th['overhead'])} | {_after_save(s)} | {fmt_s(s['restore_warm_s'])} | {_cold(s)} "
            f"| {fmt_b(s['peak_rss_delta_bytes'])} / {fmt_b(s.get('restore_peak_rss_delta_bytes'))} "
            f"| {wtxt} | {_status(s)} |")
    head = (f"### {w['name']}: {w.get('description', '')}\n\n"
            f"State {fmt_b(w.get('state_bytes'))} in {w.get('num_tensors')} tensors "
            f"({w.get('params', 0) / 1e6:.1f}M parameters), training step {fmt_s(w.get('step_s'))}"
            + (f"; overhead = throughput loss with a checkpoint every {iv} steps" if iv else "") + "."
            + _floor_line(w) + _restore_floor_line(w) + "\n\n")
    return head + "\n".join(rows) + "\n"


def _floor_line(w: dict[str, Any]) -> str:
    fl = w.get("snapshot_floor") or {}
    if "overhead" not in fl:
        return ""
    per = ", ".join(fmt_pct(r["overhead"]) for r in fl.get("rounds", []) if "overhead" in r)
    return (f" Snapshot floor (bare copy of the state every {fl['interval']} steps, no I/O): "
            f"{fmt_pct(fl['overhead'])} overhead (rounds: {per}).")


def _restore_floor_line(w: dict[str, Any]) -> str:
    fl = w.get("restore_floor") or {}
    if "warm_s" not in fl:
        return ""
    return (f" Restore floor (the state's {fmt_b(fl['bytes'])} read once, CRC32C-checked once and copied once into "
            f"the live tensors, nothing else): warm {fmt_s(fl['warm_s'])}, cold {fmt_s(fl['cold_s'])} "
            f"(readinto a buffer {fmt_s(fl['read_warm_s'])} / {fmt_s(fl['read_cold_s'])}, mmap "
            f"{fmt_s(fl['mmap_warm_s'])} / {fmt_s(fl['mmap_cold_s'])})." + _tmpfs_floor_line(w))


def _tmpfs_floor_line(w: dict[str, Any]) -> str:
    fl = w.get("restore_floor_tmpfs") or {}
    if "warm_s" not in fl:
        return ""
    return (f" The same from the memory tier's tmpfs (its floor): {fmt_s(fl['warm_s'])} (readinto "
            f"{fmt_s(fl['read_warm_s'])}, mmap {fmt_s(fl['mmap_warm_s'])}).")


def _load(la: Optional[list[float]]) -> str:
    return "n/a" if not la else f"{la[0]:.1f}"


def _busy(m: dict[str, Any]) -> bool:
    cores = m.get("usable_cores") or 1
    return any(la and la[0] > 0.5 * cores for la in (m.get("loadavg_start"), m.get("loadavg_end")))


def _single_process_sections(results: dict[str, Any]) -> list[str]:
    """The limits measured and the single-process workloads' tables."""
    lim = results.get("limits", {})
    lines = ["## Limits measured in this run", "", "| limit | GB/s | samples |", "|---|---:|---|"]
    for key, title in (("seq_write_fsync", "sequential write (16 MiB chunks) + fsync"),
                       ("memcpy", "copy_ into a pre-touched buffer"), ("d2h_pinned", "CUDA D2H into pinned")):
        v = lim.get(key) or {}
        if v.get("gbps") is not None:
            lines.append(f"| {title}, {fmt_b(v.get('bytes'))} | {v['gbps']:.2f} | "
                         + ", ".join(f"{g:.2f}" for g in v.get("samples_gbps", [])) + " |")
        elif v.get("error"):
            lines.append(f"| {title} | n/a | {v['error']} |")
    lines += ["", "## Results", "", METHOD, ""]
    for w in results.get("workloads", []):
        if w.get("status") != "ok":
            lines += [f"### {w['name']}: skipped - {w.get('reason')}", ""]
            continue
        lines += [workload_table(w), ""]
    return lines


def render_markdown(results: dict[str, Any]) -> str:
    """The whole ``results.md``."""
    m = results.get("machine", {})
    st = results.get("settings", {})
    lines = ["# nebula_ckpt benchmark", "",
             f"{results.get('created')} · `{' '.join(results.get('argv', []))}`"
             + (" · **quick run** (tiny model, few reps: not representative)" if results.get("quick") else ""),
             "", "## Machine", "",
             f"- CPU: {m.get('cpu_model')}, {m.get('usable_cores')} usable cores, torch threads "
             f"{m.get('torch_threads')}; memory {fmt_b(m.get('memory_bytes'))}; GPU: {m.get('gpu') or 'none'}",
             f"- torch {m.get('torch')}, kernel {m.get('kernel')}, python {m.get('python')}; nebula_ckpt "
             f"path: {(m.get('nebula_native') or {}).get('path', 'n/a')}"
             + (f" ({m['nebula_native']['reason']})" if (m.get('nebula_native') or {}).get('reason') else ""),
             f"- target: `{results.get('target')}` on {m.get('target_fs')} ({m.get('target_device')}, "
             f"rotational: {m.get('target_rotational')})"
             + (" - **tmpfs: durable times measure RAM, not a disk**" if m.get("target_is_tmpfs") else ""),
             f"- device: {results.get('device')}; reps {st.get('reps')} (+1 warm-up) per system; "
             f"throughput loops of {st.get('steps')} steps",
             f"- load average at start / end: {_load(m.get('loadavg_start'))} / {_load(m.get('loadavg_end'))}"
             + (" - **other work was running: timings are noisy**" if _busy(m) else ""), ""]
    if not (st.get("ranks_only") or st.get("recovery_only")):  # no limits, no single-process workloads
        lines += _single_process_sections(results)
    lines += rank_report.render_markdown(results)
    lines += recovery_report.render_markdown(results)
    lines += ["## Targets", "", "| target | workload | value | threshold | verdict | detail |",
              "|---|---|---|---|---|---|"]
    for t in results.get("targets", []):
        verdict = {True: "✅ met", False: "❌ not met", None: "n/a"}[t["met"]]
        lines.append(f"| {t['title']} | {t.get('workload') or '-'} | {t['value']} | {t['threshold']} "
                     f"| {verdict} | {t.get('detail', '')} |")
    if results.get("peers"):
        lines += ["", "## How each system is called", ""]
    for name, p in results.get("peers", {}).items():
        lines.append(f"- **{name}**: {p['calls']}. Durability: {p['durability']}.")
    cold = {s.get("cold_method") for w in results.get("workloads", []) for s in w.get("systems", [])
            if s.get("cold_method")}
    if cold:
        lines += ["", f"Cold restores evict the checkpoint files with: {', '.join(sorted(cold))} "
                  "(residency checked with mincore)."]
    lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------- plot

def plot(results: dict[str, Any], path: Any) -> None:
    """``results.png``: blocking and time to durable per system, log scale, one panel per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws = [w for w in results.get("workloads", []) if w.get("status") == "ok"]
    if not ws:
        ws = [{"name": "no workload ran", "systems": []}]
    fig, axes = plt.subplots(len(ws), 1, figsize=(10, 4.2 * len(ws)), squeeze=False)
    for ax, w in zip(axes[:, 0], ws, strict=True):
        ok = [s for s in w.get("systems", []) if s.get("status") == "ok"]
        names = [s["name"] for s in ok]
        xs = list(range(len(names)))
        blk = [_med(s, "blocking_s") for s in ok]
        p95 = [s["blocking_s"]["p95"] for s in ok]
        dur = [_med(s, "durable_s") for s in ok]
        wd = 0.38
        b1 = ax.bar([x - wd / 2 for x in xs], blk, wd, label="blocking (median, bar to p95)", color="#d95f02",
                    yerr=[[0] * len(blk), [max(0.0, p - b) for p, b in zip(p95, blk, strict=True)]], capsize=3)
        b2 = ax.bar([x + wd / 2 for x in xs], dur, wd, label="time to durable (median, during training)",
                    color="#1b9e77")
        for bars in (b1, b2):
            ax.bar_label(bars, labels=[fmt_s(v) for v in bars.datavalues], fontsize=7, padding=2)
        ax.set_yscale("log")
        ax.set_xticks(xs, names, rotation=20, ha="right")
        ax.set_ylabel("seconds (log)")
        ax.set_title(f"{w['name']}: state {fmt_b(w.get('state_bytes'))}")
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2,
                  frameon=False)
    fig.suptitle(f"nebula_ckpt benchmark ({results.get('device')}, {results.get('machine', {}).get('target_fs')})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
