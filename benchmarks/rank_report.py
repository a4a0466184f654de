"""The multi-rank section of the results: records of every rank aggregated, targets, markdown.

Reads only the records the ranks wrote (:mod:`benchmarks.rank_jobs`) and the section
:func:`benchmarks.ranks.run` built; renders through :mod:`benchmarks.common`.
"""

from __future__ import annotations

import statistics
from typing import Any, Optional

from benchmarks.common import fmt_b, fmt_pct, fmt_s, summary, target
from benchmarks.rank_peers import DCP_SHARD, NEBULA_SHARD

#: the blocking target: nebula's blocking per rank within this factor of the single-process figure
BLOCKING_FACTOR = 2.0


METHOD = (
    "Each row is one job of W spawned processes (gloo on 127.0.0.1) training a DDP-replicated model with "
    "AdamW; every system runs in turn on the same job. Blocking = save call + stall before the next "
    "optimizer step on one rank; per rep the slowest rank's, median / p95 over reps. Time to commit: from "
    "the earliest rank's save call until durable on every rank (nebula: `result()` returned on every rank, "
    "rank 0 wrote COMMIT; DCP: `save` / the async future returned on every rank, rank 0 wrote `.metadata`), "
    "directory fsyncs included; while the next training step runs / with the training thread idle. Written "
    "per rank: sizes of the files of the newest checkpoint each rank wrote (nebula "
    "`shard-g<G>-r<R>.safetensors`, DCP `__<R>_0.distcp`; manifest, COMMIT and `.metadata` count for rank "
    "0; nebula's memory tier in /dev/shm is not counted). Overhead: the runner's interleaved throughput "
    "rounds on every rank (a save every K steps vs none), the largest over ranks. The 1-rank row is a "
    "single process (no process group, no DDP) of the same model: the reference of the blocking target.")


# --------------------------------------------------------------------------- aggregation

def _rank_of(name: str) -> int:
    m = NEBULA_SHARD.fullmatch(name) or DCP_SHARD.fullmatch(name)
    return int(m.group(1)) if m else 0


def bytes_per_rank(files: dict[str, int], world: int) -> list[int]:
    """Sizes of the newest checkpoint's files by the rank that wrote them (by name; the rest: rank 0)."""
    out = [0] * world
    for name, size in files.items():
        r = _rank_of(name)
        out[r if r < world else 0] += size
    return out


def aggregate(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's row from every rank's record (see the module docstring)."""
    world = len(recs)
    n = len(recs[0]["reps"])
    reps = [[rec["reps"][i] for rec in recs] for i in range(n)]
    row: dict[str, Any] = {"status": "ok", "reason": None, "ranks": world, "reps": n}
    for k in ("call", "stall", "blocking"):
        row[f"{k}_s"] = summary([max(x[k] for x in rep) for rep in reps])
    row["blocking_per_rank_median_s"] = [statistics.median(x["blocking"] for x in rec["reps"]) for rec in recs]
    row["commit_s"] = summary([max(x["done"] for x in rep) - min(x["t0"] for x in rep) for rep in reps])
    m = len(recs[0]["idle"])
    idle = [max(rec["idle"][i]["done"] for rec in recs) - min(rec["idle"][i]["t0"] for rec in recs)
            for i in range(m)]
    row["commit_idle_s"] = summary(idle) if idle else row["commit_s"]
    files = recs[0].get("files", {})
    row["bytes_per_rank"] = bytes_per_rank(files, world)
    row["bytes_max_rank"] = max(row["bytes_per_rank"])
    row["ckpt_bytes"] = sum(files.values())
    row["files"] = len(files)
    ov = [rec["throughput"]["overhead"] for rec in recs]
    row["overhead"] = max(ov)
    row["overhead_per_rank"] = ov
    th0 = recs[0]["throughput"]
    row["throughput"] = {k: th0.get(k) for k in ("steps", "interval", "saves", "backlog_s", "tiers_dropped",
                                                 "saves_skipped")}
    row["backlog_s"] = max(rec["throughput"].get("backlog_s", 0.0) for rec in recs)
    for k in ("state_bytes", "params", "num_tensors", "description"):
        row[k] = recs[0].get(k)
    row["step_s"] = max(rec.get("step_s", 0.0) for rec in recs)
    if recs[0].get("stats"):
        row["stats_rank0"] = recs[0]["stats"]
    if any(rec.get("events") for rec in recs):
        row["phases"] = phase_medians(recs, "reps")
        row["phases_idle"] = phase_medians(recs, "idle")
    row["cores_per_rank"] = recs[0].get("cores_per_rank")
    return row


#: the phases of one nebula save on the shared tier (see :func:`save_phases`)
PHASE_NAMES = ("to_rounds", "pre_rounds", "shard_write", "protocol", "ack")


def round_maps(recs: list[dict[str, Any]]) -> list[dict[int, dict[int, dict[str, Any]]]]:
    """Per rank: step -> phase -> timestamped round. The step of a save's rounds is the one its
    first round's payload names (every round of one (tier, save index) belongs to one step)."""
    out = []
    for rec in recs:
        evs = rec.get("events") or []
        idx_step: dict[tuple[str, int], int] = {}
        for e in sorted(evs, key=lambda e: e["phase"]):
            if e.get("step") is not None:
                idx_step.setdefault((e["tier"], e["index"]), int(e["step"]))
        m: dict[int, dict[int, dict[str, Any]]] = {}
        for e in evs:
            step = idx_step.get((e["tier"], e["index"]))
            if step is not None:
                m.setdefault(step, {})[e["phase"]] = e
        out.append(m)
    return out


def save_phases(saves: list[dict[str, Any]], maps: list[dict[int, dict[int, dict[str, Any]]]],
                step: int) -> Optional[dict[str, float]]:
    """Where one multi-rank nebula save spent its time, from every rank's save record and rounds
    (None without every round). Each phase is the slowest rank's:

    * ``to_rounds``: save call -> the tier thread posting the save's first round (snapshot, queueing);
    * ``pre_rounds``: the rounds before the shard write (digest / tensor index: who writes what),
      waiting for the slowest rank included;
    * ``shard_write``: those rounds done -> this rank's shard durable (posting the "durable" round);
    * ``protocol``: the last rank's shard durable -> rank 0 entering the verdict round (manifest and
      COMMIT written): the commit protocol proper;
    * ``ack``: -> every rank's ``result()`` returned (the verdict round, the handles).

    The phase numbers come from :mod:`nebula_ckpt.ranks.coordinator` (``PHASE_DURABLE``, ``PHASE_VERDICT``).
    """
    from nebula_ckpt.ranks.coordinator import PHASE_DURABLE, PHASE_VERDICT

    ev = [m.get(step, {}) for m in maps]
    pre = [[e[k] for k in sorted(e) if k < PHASE_DURABLE] for e in ev]
    if any(PHASE_DURABLE not in e or not p for e, p in zip(ev, pre, strict=True)) or PHASE_VERDICT not in ev[0]:
        return None
    last_durable = max(e[PHASE_DURABLE]["enter"] for e in ev)
    verdict = ev[0][PHASE_VERDICT]["enter"]
    return {"to_rounds": max(p[0]["enter"] - s["t0"] for p, s in zip(pre, saves, strict=True)),
            "pre_rounds": max(p[-1]["exit"] - p[0]["enter"] for p in pre),
            "shard_write": max(e[PHASE_DURABLE]["enter"] - p[-1]["exit"] for e, p in zip(ev, pre, strict=True)),
            "protocol": verdict - last_durable,
            "ack": max(s["done"] for s in saves) - verdict}


def phase_medians(recs: list[dict[str, Any]], key: str) -> Optional[dict[str, Any]]:
    """Median of each of :data:`PHASE_NAMES` over the saves ``rec[key]`` of every rank (None if no
    save has its rounds)."""
    maps = round_maps(recs)
    n = min(len(rec.get(key) or []) for rec in recs)
    got = []
    for i in range(n):
        saves = [rec[key][i] for rec in recs]
        if saves[0].get("step") is None or saves[0].get("warmup"):
            continue
        ph = save_phases(saves, maps, int(saves[0]["step"]))
        if ph is not None:
            got.append(ph)
    if not got:
        return None
    return {"saves": len(got), **{k: statistics.median(g[k] for g in got) for k in PHASE_NAMES}}


def aggregate_protocol(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """Protocol times per save from every rank's timestamped rounds and saves."""
    world = len(recs)
    maps = round_maps(recs)
    proto, ack, commit, shard_write, mtime = [], [], [], [], []
    for i, s0 in enumerate(recs[0]["saves"]):
        if s0.get("warmup"):
            continue
        save = [rec["saves"][i] for rec in recs]
        commit.append(max(s["done"] for s in save) - min(s["t0"] for s in save))
        f = s0.get("files") or {}
        if f.get("commit") and f.get("shards"):
            mtime.append((f["commit"] - max(f["shards"].values())) / 1e9)
        ph = save_phases(save, maps, int(s0["step"]))
        if ph is not None:
            proto.append(ph["protocol"])
            ack.append(ph["protocol"] + ph["ack"])
            shard_write.append(ph["shard_write"])
    row: dict[str, Any] = {"status": "ok", "reason": None, "ranks": world, "saves": len(commit),
                           "state_bytes": recs[0].get("state_bytes"),
                           "protocol_s": summary(proto), "protocol_ack_s": summary(ack),
                           "protocol_mtime_s": summary(mtime), "shard_write_s": summary(shard_write),
                           "commit_s": summary(commit), "phases": phase_medians(recs, "saves")}
    if not proto:
        row["note"] = ("no timestamped protocol rounds (the coordinator's round() was not called): "
                       "protocol taken from file mtimes only")
    return row


# --------------------------------------------------------------------------- targets

def _row(sec: dict[str, Any], world: int, system: str) -> Optional[dict[str, Any]]:
    r = next((r for r in sec.get("rows", []) if r["world"] == world and r["system"] == system), None)
    return r if r is not None and r.get("status") == "ok" else None


def _med(row: Optional[dict[str, Any]], key: str) -> Optional[float]:
    v = (row or {}).get(key)
    return v.get("median") if isinstance(v, dict) else None


def _cpr(row: Optional[dict[str, Any]]) -> str:
    c = (row or {}).get("cores_per_rank")
    return "n/a" if c is None else f"{c:g}"


def _phase_line(label: str, ph: Optional[dict[str, Any]]) -> str:
    if not ph:
        return ""
    return (f"{label}: " + ", ".join(f"{k.replace('_', ' ')} {fmt_s(ph[k])}" for k in PHASE_NAMES)
            + f" ({ph['saves']} saves)")


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The multi-rank targets (``met`` None for n/a): blocking per rank within 2x of one process,
    time to commit falling as ranks share the replicated bytes, ahead of ``dcp.async_save``."""
    sec = results.get("ranks")
    if not sec or not sec.get("ranks"):
        return []
    out: list[dict[str, Any]] = []
    single = sec.get("single") if (sec.get("single") or {}).get("status") == "ok" else None
    sb = _med(single, "blocking_s")
    for world in sec["ranks"]:
        neb = _row(sec, world, "nebula")
        nb = _med(neb, "blocking_s")
        title = f"nebula blocking per rank <= {BLOCKING_FACTOR:g}x single-process"
        if nb is None or not sb:
            out.append(target("ranks_blocking", title, None, "n/a", f"<= {BLOCKING_FACTOR:g}x", f"{world} ranks",
                               "nebula did not run" + (" (single process)" if not sb else f" at {world} ranks")))
            continue
        r = nb / sb
        out.append(target("ranks_blocking", title, r <= BLOCKING_FACTOR, f"{r:.2f}x ({fmt_s(nb)} vs {fmt_s(sb)})",
                           f"<= {BLOCKING_FACTOR:g}x", f"{world} ranks",
                           f"slowest rank per rep; p95 {fmt_s((neb or {}).get('blocking_s', {}).get('p95'))}; "
                           f"cores per rank {_cpr(neb)} vs {_cpr(single)} for the single process"))
    # persist time falling as the ranks share the replicated bytes
    seq = [(1, single)] + [(w, _row(sec, w, "nebula")) for w in sec["ranks"]]
    have = [(w, _med(r, "commit_idle_s"), (r or {}).get("bytes_max_rank")) for w, r in seq]
    title = "nebula time to commit falls as ranks share replicated bytes"
    times = [t for _, t, _ in have if t is not None]
    if len(times) < len(have):
        out.append(target("ranks_persist", title, None, "n/a", "strictly falling with ranks", None,
                           "nebula did not run at every rank count"))
    else:
        met = all(b < a for a, b in zip(times, times[1:], strict=False))
        out.append(target("ranks_persist", title, met,
                           ", ".join(f"{w}: {fmt_s(t)}" for w, t, _ in have), "strictly falling with ranks", None,
                           "idle time to commit (median); largest share written by one rank: "
                           + ", ".join(f"{w}: {fmt_b(b)}" for w, _, b in have)))
    # ahead of dcp.async_save on every row
    title = "nebula ahead of dcp.async_save on every row"
    verdicts: list[Optional[bool]] = []
    parts: list[str] = []
    for world in sec["ranks"]:
        neb, dca = _row(sec, world, "nebula"), _row(sec, world, "dcp_async_save")
        if neb is None or dca is None:
            parts.append(f"{world} ranks: n/a")
            verdicts.append(None)
            continue
        cmp = {"blocking": (_med(neb, "blocking_s"), _med(dca, "blocking_s")),
               "commit": (_med(neb, "commit_s"), _med(dca, "commit_s")),
               "overhead": (neb["overhead"], dca["overhead"])}
        lost = [k for k, (x, y) in cmp.items() if x is None or y is None or not x < y]
        verdicts.append(not lost)
        parts.append(f"{world} ranks: blocking {fmt_s(cmp['blocking'][0])} vs {fmt_s(cmp['blocking'][1])}, "
                     f"commit {fmt_s(cmp['commit'][0])} vs {fmt_s(cmp['commit'][1])}, overhead "
                     f"{fmt_pct(cmp['overhead'][0])} vs {fmt_pct(cmp['overhead'][1])}"
                     + (f" (behind on {', '.join(lost)})" if lost else ""))
    ahead: Optional[bool] = None if any(v is None for v in verdicts) or not verdicts else all(verdicts)
    out.append(target("ranks_vs_dcp_async", title, ahead,
                       f"{sum(1 for v in verdicts if v)}/{len(verdicts)} rows ahead",
                       "lower blocking, time to commit and overhead", None, "; ".join(parts)))
    return out


# --------------------------------------------------------------------------- markdown

def _row_line(label: str, r: dict[str, Any]) -> str:
    if r.get("status") != "ok":
        return f"| {label} | {r.get('system')} |" + " n/a |" * 6 + f" {r.get('status')}: {r.get('reason')} |"
    per = r["bytes_per_rank"]
    notes = []
    th = r.get("throughput") or {}
    if th.get("tiers_dropped"):
        notes.append(f"{th['tiers_dropped']} tier write(s) dropped")
    if r.get("backlog_s") and th.get("saves"):
        notes.append(f"backlog {fmt_s(r['backlog_s'] / th['saves'])} per save")
    return (f"| {label} | {r['system']} | {fmt_s(_med(r, 'blocking_s'))} | {fmt_s(r['blocking_s']['p95'])} "
            f"| {fmt_s(_med(r, 'commit_s'))} / {fmt_s(_med(r, 'commit_idle_s'))} "
            f"| {fmt_b(max(per))} / {fmt_b(sum(per))} ({', '.join(fmt_b(b) for b in per)}) "
            f"| {fmt_pct(r['overhead'])} | {fmt_s(r.get('step_s'))} | {'; '.join(notes) or 'ok'} |")


def render_markdown(results: dict[str, Any]) -> list[str]:
    """The ``## Multi-rank`` section of ``results.md`` (empty when no multi-rank case ran)."""
    sec = results.get("ranks")
    if not sec:
        return []
    lines = ["## Multi-rank", ""]
    if sec.get("error"):
        return lines + [f"Not run: {sec['error']}", ""]
    if sec.get("rows") or sec.get("single"):
        lines += [f"Model `{sec.get('model')}`: {sec.get('description', 'n/a')}; state "
                  f"{fmt_b(sec.get('state_bytes'))} per rank (replicated).", "", METHOD, "",
                  "| ranks | system | blocking median | blocking p95 | time to commit (training / idle) "
                  "| written per rank: max / all (each rank) | overhead | train step | status |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---|"]
        if sec.get("single"):
            lines.append(_row_line("1 (one process)", {**sec["single"], "system": "nebula"}))
        for r in sec.get("rows", []):
            lines.append(_row_line(str(r["world"]), r))
        phases = [_phase_line(f"{r['world']} ranks, {kind}", r.get(key)) for r in sec.get("rows", [])
                  if r.get("system") == "nebula" for kind, key in (("training", "phases"), ("idle", "phases_idle"))]
        if any(phases):
            lines += ["", "Where nebula's multi-rank saves spend their time (medians of the slowest rank per phase: "
                      "save call -> first protocol round posted, the rounds before the shard write (who writes "
                      "what), shard write until durable, last shard durable -> COMMIT written, -> every rank's "
                      "result()):", ""]
            lines += [f"- {ln}" for ln in phases if ln]
        lines += ["", "How each system is called:", ""]
        lines += [f"- **{n}**: {c}." for n, c in sec.get("calls", {}).items()]
        lines.append("")
    if sec.get("protocol"):
        lines += ["### nebula commit protocol time", "",
                  "Tiny state (`micro` model), saves with the training thread idle. Protocol = rank 0 entering "
                  "the verdict round (manifest.json and COMMIT written) minus the last rank entering the "
                  "'durable' round (its shard fsynced): gather of the shard records, manifest, commit marker. "
                  "Until acknowledged: until every rank's `result()` returned. By mtimes: COMMIT's mtime minus "
                  "the newest shard's (includes that shard's fsync). Rounds before the shard: the protocol's "
                  "rounds that decide who writes what (median). Medians (p95).", "",
                  "| ranks | state | saves | protocol | until acknowledged | by mtimes | rounds before the shard "
                  "| slowest shard write | time to commit | status |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for p in sec["protocol"]:
            if p.get("status") != "ok":
                lines.append(f"| {p['world']} |" + " n/a |" * 8 + f" {p.get('status')}: {p.get('reason')} |")
                continue

            def mp(key: str, p: dict[str, Any] = p) -> str:
                return f"{fmt_s(p[key]['median'])} ({fmt_s(p[key]['p95'])})"

            lines.append(f"| {p['world']} | {fmt_b(p.get('state_bytes'))} | {p['saves']} | {mp('protocol_s')} "
                         f"| {mp('protocol_ack_s')} | {mp('protocol_mtime_s')} "
                         f"| {fmt_s((p.get('phases') or {}).get('pre_rounds'))} | {mp('shard_write_s')} "
                         f"| {mp('commit_s')} | {p.get('note', 'ok')} |")
        lines.append("")
    return lines
