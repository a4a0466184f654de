"""The recovery section of the results: repetitions aggregated, targets, markdown.

Turns the records of :mod:`benchmarks.recovery_worker`'s processes into the rows of the
recovery table and the recovery targets (each met / not met / n/a, never tuned away); renders
through :mod:`benchmarks.common`.
"""

from __future__ import annotations

from typing import Any, Optional

from benchmarks.common import fmt_b, fmt_s, summary, target
from benchmarks.recovery_worker import FIRST_SAVES

ROWS: tuple[tuple[str, str, str], ...] = (
    ("nebula_memory", "nebula_memory", "after crash"),
    ("nebula_local", "nebula_local", "warm"),
    ("torch_load", "torch_load", "warm"),
    ("torch_load_mmap", "torch_load_mmap", "warm"),
    ("nebula_local_cold", "nebula_local", "cold"),
    ("torch_load_cold", "torch_load", "cold"),
    ("torch_load_mmap_cold", "torch_load_mmap", "cold"),
)
#: targets (see :func:`evaluate_targets`)
MEMORY_SPEEDUP = 0.5
RSS_FACTOR = 1.1
FIRST_SAVE_FACTOR = 1.2
FLOOR_FACTOR = 1.2
#: host memory, shm space and disk space a size needs, as multiples of its state bytes: the saving

CALLS = {
    "nebula_memory": "saving process: nc.Checkpointer(root) (default tiers: memory tier + root), h = "
                     "ck.save_async(1, {model, optim, step}); h.result(); os.kill(getpid(), SIGKILL). Restart: "
                     "nc.Checkpointer(root).load_latest(into={model, optim, step}) (must restore from the memory tier)",
    "nebula_local": "saving process: nc.Checkpointer(root, memory_tier=False), save_async -> result() -> close(). "
                    "Restart: nc.Checkpointer(root).load_latest(into=...) (no memory tier: reads the root)",
    "torch_load": "saving process: torch.save({model: sd, optim: osd, step}, f) + fsync(file, dir). Restart: "
                  "sd = torch.load(f, map_location='cpu', weights_only=True); model.load_state_dict(sd['model']); "
                  "opt.load_state_dict(sd['optim'])",
    "torch_load_mmap": "same file; torch.load(f, map_location='cpu', weights_only=True, mmap=True)",
}

METHOD = (
    "Each restart is a fresh process with the model and AdamW already built (optimizer state empty). Load = from "
    "before the load call (`nc.Checkpointer(root)` included) until `load_latest` / `load_state_dict` returns; to "
    "first step = until one full training step (forward, backward, `optimizer.step()`) after it is done (a "
    "mapped load pays its page faults there). Extra peak RSS = the process's VmHWM after that step (high-water "
    "mark reset just before the load) minus its VmRSS before the load, as a multiple of the state bytes; pages of "
    "a mapped file (shm or page cache) count once touched; of the load alone = the same at the end of the load "
    "(the optimizer state a restore must create is 2/3 of the state with AdamW: 0.67x is the floor; the first "
    "step adds the gradients, 1/3, and AdamW's temporaries, one or two of the largest parameter's size). Handed "
    "over = bytes the memory tier gave the restart without a copy (`last_restore['adopted_bytes']`). Bit-exact: "
    "the state after the first step has the digest the saving process reached with the same step from the "
    "state it saved. nebula_memory restarts right "
    "after the saving process was SIGKILLed; warm: the files were read once just before; cold: evicted with "
    "posix_fadvise(DONTNEED). Medians over the repetitions, each with its own fresh processes.")


def aggregate_row(row: str, system: str, cache: str, reps: list[dict[str, Any]],
                  state_bytes: int) -> dict[str, Any]:
    """One restart row over the repetitions: medians, restore and tier checks, status."""
    ok = [r for r in reps if "error" not in r]
    out: dict[str, Any] = {"row": row, "system": system, "cache": cache, "reps": reps, "status": "ok",
                           "reason": None, "calls": CALLS[system]}
    errors = [r["error"] for r in reps if "error" in r]
    if ok:
        for key in ("load_s", "first_step_s", "step_s", "extra_rss_bytes", "extra_rss_load_bytes"):
            out[key] = summary([float(r[key]) for r in ok])
        out["extra_rss_ratio"] = out["extra_rss_bytes"]["median"] / state_bytes
        out["extra_rss_load_ratio"] = out["extra_rss_load_bytes"]["median"] / state_bytes
        out["restore_ok"] = all(r.get("restore_ok") is True for r in ok)
        out["tiers"] = sorted({r["tier"] for r in ok if r.get("tier")})
        fr = [r["resident_fraction"] for r in ok if r.get("resident_fraction") is not None]
        out["resident_fraction"] = max(fr) if cache == "cold" and fr else (min(fr) if fr else None)
        if any(r.get("open_s") is not None for r in ok):
            out["open_s"] = summary([float(r["open_s"]) for r in ok if r.get("open_s") is not None])
        if system.startswith("nebula"):
            out["tier_ok"] = all(r.get("tier_ok") is True for r in ok)
        if system == "nebula_memory":
            out["from_memory_tier"] = out["tier_ok"]
            out["adopted_bytes"] = min(int(r.get("adopted_bytes") or 0) for r in ok)
    else:
        out["restore_ok"] = False
    if errors:
        out.update(status="error", reason=f"{len(errors)} of {len(reps)} repetition(s) failed: {errors[0]}")
    elif out.get("tier_ok") is False:
        want = "the memory tier" if system == "nebula_memory" else "the local root"
        out.update(status="error", reason=f"restored from {', '.join(out['tiers']) or 'nothing'}, not {want}")
    elif out["restore_ok"] is not True:
        out.update(status="error", reason="restored state is not bit-exact (digest after the first step differs)")
    return out


def aggregate_saves(res: dict[str, Any]) -> dict[str, Any]:
    """The first-save and floor figures of one ``saves`` worker."""
    stalls = [s["stall_s"] for s in res["saves"]]
    later = stalls[FIRST_SAVES:]
    out = {"status": "ok", "reason": None, "tiers": res["tiers"], "state_bytes": res["state_bytes"],
           "first_stalls_s": stalls[:FIRST_SAVES], "later_stall_s": summary(later),
           "calls_s": [s["call_s"] for s in res["saves"]], "durable_s": [s["durable_s"] for s in res["saves"]],
           "torch_save_s": summary(res["torch_save_s"]), "copy_s": summary(res["copy_s"]),
           "train_step_s": summary(res["train_step_s"]), "stats": res.get("stats")}
    if not any(str(t).startswith("memory:") for t in res["tiers"]):
        out["note"] = "no memory tier (the shm folder refused it): saves went to the local root only"
    lm = out["later_stall_s"]["median"]
    out["first_two_ratio"] = max(stalls[:2]) / lm if lm else None
    cm = out["copy_s"]["median"]
    out["floor_ratio"] = lm / cm if lm is not None and cm else None
    out["copy_gbps"] = res["state_bytes"] / cm / 1e9 if cm else None
    return out


# --------------------------------------------------------------------------- targets and report

def _row(size: dict[str, Any], name: str) -> Optional[dict[str, Any]]:
    r = next((r for r in size.get("rows", []) if r["row"] == name), None)
    return r if r and r.get("status") == "ok" else None


def _med(r: Optional[dict[str, Any]], key: str) -> Optional[float]:
    v = (r or {}).get(key)
    return v.get("median") if isinstance(v, dict) else None


def _label(size: dict[str, Any]) -> str:
    return f"{size['size_gb']:g} GB"


def _memory_target(s: dict[str, Any]) -> dict[str, Any]:
    title = f"restart from memory <= {MEMORY_SPEEDUP:g}x the better of torch.load / mmap (to first step)"
    mem = _row(s, "nebula_memory")
    peers = [(n, _med(_row(s, n), "first_step_s")) for n in ("torch_load", "torch_load_mmap")]
    have = [(n, t) for n, t in peers if t is not None]
    m = _med(mem, "first_step_s")
    if m is None or not have:
        why = "nebula_memory did not restore from the memory tier" if m is None else "no torch.load row"
        return target("recovery_memory", title, None, "n/a", f"<= {MEMORY_SPEEDUP:g}x", _label(s), why)
    best, bt = min(have, key=lambda x: x[1])
    r = m / bt
    return target("recovery_memory", title, r <= MEMORY_SPEEDUP, f"{r:.2f}x ({fmt_s(m)} vs {fmt_s(bt)} {best})",
                   f"<= {MEMORY_SPEEDUP:g}x", _label(s),
                   f"page cache warm for torch; load alone {fmt_s(_med(mem, 'load_s'))} vs "
                   f"{fmt_s(_med(_row(s, best), 'load_s'))}")


def _rss_target(s: dict[str, Any]) -> dict[str, Any]:
    title = f"nebula_memory extra peak RSS <= {RSS_FACTOR:g}x state (restart + first step)"
    mem = _row(s, "nebula_memory")
    if mem is None:
        return target("recovery_rss", title, None, "n/a", f"<= {RSS_FACTOR:g}x", _label(s), "nebula_memory failed")
    r = mem["extra_rss_ratio"]
    peers = [(n, _row(s, n)) for n in ("torch_load", "torch_load_mmap")]
    others = "; ".join(f"{n} {p['extra_rss_ratio']:.2f}x (load alone {p['extra_rss_load_ratio']:.2f}x)"
                       for n, p in peers if p is not None)
    return target("recovery_rss", title, r <= RSS_FACTOR, f"{r:.2f}x ({fmt_b(_med(mem, 'extra_rss_bytes'))})",
                   f"<= {RSS_FACTOR:g}x", _label(s),
                   f"VmHWM - VmRSS before the load; includes the first step's gradients and AdamW temporaries; "
                   f"the load alone {mem['extra_rss_load_ratio']:.2f}x (the optimizer state it creates: 0.67x); "
                   f"{others}")


def _local_target(s: dict[str, Any]) -> dict[str, Any]:
    title = "nebula_local restore warm and cold <= torch.load (to first step)"
    parts, met = [], True
    for cache, nl_name, tl_name in (("warm", "nebula_local", "torch_load"),
                                    ("cold", "nebula_local_cold", "torch_load_cold")):
        nl, tl = _med(_row(s, nl_name), "first_step_s"), _med(_row(s, tl_name), "first_step_s")
        if nl is None or tl is None:
            return target("recovery_local", title, None, "n/a", "<= torch.load", _label(s),
                           f"{nl_name} or {tl_name} did not run")
        met = met and nl <= tl
        parts.append(f"{cache} {fmt_s(nl)} vs {fmt_s(tl)}")
    cold = _row(s, "nebula_local_cold") or {}
    return target("recovery_local", title, met, "; ".join(parts), "<= torch.load + load_state_dict", _label(s),
                   f"cold: posix_fadvise(DONTNEED), {cold.get('resident_fraction') or 0:.0%} of the files "
                   "still cached before the restart")


def _first_save_target(s: dict[str, Any], key: str = "saves") -> dict[str, Any]:
    title = f"first two saves' stall <= {FIRST_SAVE_FACTOR:g}x later saves' median" + \
        (" (after prepare())" if key == "saves_prepared" else "")
    sv = s.get(key) or {}
    if sv.get("status") != "ok" or sv.get("first_two_ratio") is None:
        return target("recovery_first_saves", title, None, "n/a", f"<= {FIRST_SAVE_FACTOR:g}x", _label(s),
                       sv.get("reason") or "not measured")
    r = sv["first_two_ratio"]
    return target("recovery_first_saves", title, r <= FIRST_SAVE_FACTOR,
                   f"{r:.2f}x ({' / '.join(fmt_s(x) for x in sv['first_stalls_s'][:2])} vs "
                   f"{fmt_s(sv['later_stall_s']['median'])})", f"<= {FIRST_SAVE_FACTOR:g}x", _label(s),
                   "stall = save_async call + wait_snapshot(); saves 3-4: "
                   + " / ".join(fmt_s(x) for x in sv["first_stalls_s"][2:]))


def _floor_target(s: dict[str, Any]) -> dict[str, Any]:
    title = f"save stall <= {FLOOR_FACTOR:g}x one copy of the state into pre-touched buffers"
    sv = s.get("saves") or {}
    if sv.get("status") != "ok" or sv.get("floor_ratio") is None:
        return target("recovery_floor", title, None, "n/a", f"<= {FLOOR_FACTOR:g}x", _label(s),
                       sv.get("reason") or "not measured")
    r = sv["floor_ratio"]
    return target("recovery_floor", title, r <= FLOOR_FACTOR,
                   f"{r:.2f}x ({fmt_s(sv['later_stall_s']['median'])} vs {fmt_s(sv['copy_s']['median'])})",
                   f"<= {FLOOR_FACTOR:g}x", _label(s),
                   f"both idle, medians, one copy right after each save; copy {sv['copy_gbps']:.2f} GB/s "
                   "(dst.copy_(src) per tensor)")


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The recovery targets per size that ran (``met`` None for n/a); skipped sizes give none."""
    sec = results.get("recovery")
    if not sec or sec.get("error"):
        return []
    out: list[dict[str, Any]] = []
    for s in sec.get("sizes", []):
        if s.get("status") != "ok":
            out.append(target("recovery_skipped", "recovery targets", None, "n/a", "-", f"{s['size_gb']:g} GB",
                               str(s.get("reason"))))
            continue
        out += [_memory_target(s), _rss_target(s), _local_target(s), _first_save_target(s),
                _first_save_target(s, "saves_prepared"), _floor_target(s)]
    return out


def _restart_line(s: dict[str, Any], r: dict[str, Any]) -> str:
    size = f"{fmt_b(s['state_bytes'])}"
    if r.get("load_s") is None:
        return f"| {size} | {r['row']} | {r['cache']} |" + " n/a |" * 7 + f" {r.get('reason')} |"
    tiers = ", ".join(sorted({t.split(":", 1)[0] for t in r.get("tiers", [])})) or "-"
    exact = "yes" if r.get("restore_ok") else "**NO**"
    status = "ok" if r["status"] == "ok" else f"**{r['reason']}**"
    load_rss = f"{r['extra_rss_load_ratio']:.2f}x" if r.get("extra_rss_load_ratio") is not None else "n/a"
    handed = fmt_b(r["adopted_bytes"]) if r.get("adopted_bytes") else "-"
    return (f"| {size} | {r['row']} | {r['cache']} | {fmt_s(_med(r, 'load_s'))} | {fmt_s(_med(r, 'first_step_s'))} "
            f"| {fmt_s(_med(r, 'step_s'))} | {r['extra_rss_ratio']:.2f}x ({fmt_b(_med(r, 'extra_rss_bytes'))}) "
            f"| {load_rss} | {tiers} | {handed} | {exact} | {status} |")


def _pressure_note(sec: dict[str, Any]) -> str:
    ps = [p for p in (sec.get("cpu_pressure_start"), sec.get("cpu_pressure_end")) if p is not None]
    if not ps:
        return ""
    note = (" CPU pressure (share of time some task waited for a CPU, last 10 s) at start / end: "
            + " / ".join(f"{p:.0%}" for p in ps))
    return note + (" - **other work competed for the CPUs: timings are noisy**." if max(ps) > 0.2 else ".")


def render_markdown(results: dict[str, Any]) -> list[str]:
    """The ``## Recovery after a crash`` section of ``results.md`` (empty when it did not run)."""
    sec = results.get("recovery")
    if not sec:
        return []
    lines = ["## Recovery after a crash", ""]
    if sec.get("error"):
        return lines + [f"Not run: {sec['error']}", ""]
    sizes = sec.get("sizes", [])
    lines += [f"MLP + AdamW sized to {', '.join(f'{x:g}' for x in sec.get('sizes_gb', []))} GB of state; "
              f"{sec.get('reps')} repetition(s), {sec.get('threads')} torch threads; memory tier in "
              f"`{sec.get('shm_dir')}`." + _pressure_note(sec), "", METHOD, "",
              "### Restart to the first optimizer step", "",
              "| state | system | page cache | load | to first step done | first step alone | extra peak RSS "
              "| of the load alone | restored from | handed over | bit-exact | status |",
              "|---|---|---|---:|---:|---:|---:|---:|---|---:|---|---|"]
    for s in sizes:
        if s.get("status") != "ok":
            lines.append(f"| {s['size_gb']:g} GB | - | - |" + " n/a |" * 8 + f" {s.get('reason')} |")
            continue
        lines += [_restart_line(s, r) for r in s["rows"]]
    lines += ["", "### First saves of a fresh process and the snapshot floor", "",
              "Stall = `save_async` call + `handle.wait_snapshot()`, after a training step, nothing in the "
              "background (each save's `result()` waited for, untimed). One copy = `dst.copy_(src)` for every "
              "tensor into buffers allocated and touched before, one right after each later save (paired: the same "
              "moment's conditions), same process.", "",
              "| state | model | staging | save 1 | save 2 | save 3 | save 4 | later saves (median) "
              "| one copy (median) | stall / copy | torch.save + fsync | training step | status |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s, key in ((s, k) for s in sizes for k in ("saves", "saves_prepared")):
        sv = s.get(key) or {}
        how = "`prepare(state)` first" if key == "saves_prepared" else "default"
        head = f"| {fmt_b(s.get('state_bytes'))} | {s.get('description', '-')} | {how} |"
        if s.get("status") != "ok" or sv.get("status") != "ok":
            lines.append(head + " n/a |" * 9 + f" {s.get('reason') or sv.get('reason')} |")
            continue
        firsts = [fmt_s(x) for x in sv["first_stalls_s"]] + ["n/a"] * (FIRST_SAVES - len(sv["first_stalls_s"]))
        ratio = f"{sv['floor_ratio']:.2f}x" if sv.get("floor_ratio") is not None else "n/a"
        lines.append(head + " " + " | ".join(firsts) + f" | {fmt_s(sv['later_stall_s']['median'])} "
                     f"| {fmt_s(sv['copy_s']['median'])} | {ratio} | {fmt_s(sv['torch_save_s']['median'])} "
                     f"| {fmt_s(sv['train_step_s']['median'])} | {sv.get('note') or 'ok'} |")
    lines += ["", "How each system saves and restarts:", ""]
    lines += [f"- **{n}**: {c}." for n, c in sec.get("calls", {}).items()]
    if sec.get("shm_left"):
        lines += ["", f"**Memory tiers left behind (removed by the benchmark): {', '.join(sec['shm_left'])}**"]
    lines.append("")
    return lines
