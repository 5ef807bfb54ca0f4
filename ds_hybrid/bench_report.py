"""Tables, the frontier plot, the docs/benchmarks.md sections and README headline lines of
``ds-hybrid bench`` (from its result JSON)."""
from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

from . import frontier as fr
from .bench_suites import SUITES

README_MARK = "<!-- bench:{name}:{end} -->"
HEADLINE_MARK = "<!-- headline:{name}:{end} -->"
OFFLOAD_MARK = "<!-- offload-table:{end} -->"
# The suites under ZeRO-Offload: the README gives them one table (plain, ZenFlow, the hybrid) in
# place of a headline line each. A suite not run yet has a row that says how to run it.
OFFLOAD_SUITES = ("offload", "offload-z3", "offload-b64", "offload-preset", "offload-preset-fp32",
                  "offload-preset-bf16", "offload-gpu")


def ds_feature(hybrid) -> bool:
    """Whether an arm's ``hybrid`` section is a DeepSpeed feature's (ZenFlow: ``{"__ds__": ...}``,
    no hybrid; its runs are ``--baseline`` runs with that added to the config)."""
    return isinstance(hybrid, dict) and "__ds__" in hybrid


def lead_unit(result: dict) -> str:
    """The unit a result's ratios are read in: seconds, or Full-step equivalents where its runs ran
    several at a time (``concurrent``)."""
    return "equivalents" if concurrent(result) else "seconds"


def slim_row(row: dict) -> dict:
    """What the result JSON keeps of one run (the analysis has the rest)."""
    keep = ("run", "final_val_loss", "train_seconds", "steps", "val_curve", "eq_curve", "eq_total", "predicted_pct",
            "peak_rss_mb", "budget", "lr", "real_step_ms", "predict_step_ms")
    out = {k: row.get(k) for k in keep}
    st = row.get("statistics", {})
    out["statistics"] = {k: st.get(k) for k in ("steps_per_phase", "backward_skipped", "partial_backward",
                                                "partial_backward_share", "backward_skipped_equivalent",
                                                "predict_accepted", "predict_rolled_back",
                                                "predicted_update_checks", "predicted_update_rolled_back",
                                                "group_predict", "judgement", "wall_clock_breakdown")}
    return out


def _f(v, fmt="{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def _ms(a: dict | None, fmt="{:.3f}") -> str:
    if not a or a.get("mean") is None:
        return "-"
    return f"{fmt.format(a['mean'])} ± {fmt.format(a['std'])}"


def _ratio_cell(a: dict, fmt: str = "{:.3f}", unit: str = "") -> str:
    if a["reached"] == 0:
        return f"not reached (0/{a['seeds']})"
    cell = _ms(a, fmt) + unit
    return cell if a["reached"] == a["seeds"] else f"{cell} ({a['reached']}/{a['seeds']})"


def best_arm(result: dict, unit: str = "seconds", target: str = "target+1%",
             every_seed: bool = True) -> tuple[str, dict] | None:
    """The hybrid system with the lowest mean frontier ratio that reached the target on every seed
    (``every_seed=False``: on the most seeds, then the lowest mean over those; None where none did)."""
    cands = [(name, a["aggregate"][unit][target]) for name, a in result["analysis"]["arms"].items()
             if result["arms"].get(name, {}).get("hybrid") not in (None,) and name != "default"
             and not ds_feature(result["arms"][name].get("hybrid"))]
    cands = [(n, a) for n, a in cands if a["mean"] is not None
             and (a["reached"] == a["seeds"] if every_seed else a["reached"] > 0)]
    return min(cands, key=lambda c: (-c[1]["reached"], c[1]["mean"])) if cands else None


def _tie_break(result: dict) -> str:
    """The sweep's tie-break, where LRs were within 1% on its seed: their mean over every seed."""
    tb = result.get("sweep_tie_break") or {}
    if not tb:
        return ""
    means = ", ".join(f"x{m}: {sum(by.values()) / len(by):.4f}" for m, by in tb.items())
    return f"; within 1% of the best there, so run on every seed, mean final loss {means}"


def _own_lrs(result: dict) -> str:
    """The LR each ``own_lr`` arm (another system's baseline) picked from its own sweep."""
    own = result.get("own_lr") or {}
    if not own:
        return "every system runs at that LR. "
    base = result["best_lr"] / result["best_lr_multiplier"]
    parts = []
    for name, o in own.items():
        sweep = ", ".join(f"x{m}: {r['final_val_loss']:.4f}" for m, r in o["sweep"].items())
        parts.append(f"`{name}` tunes its own the same way, {sweep} (x{o['best_lr'] / base:g} = lr {o['best_lr']:g})")
    return f"the hybrid runs at that LR; {'; '.join(parts)}. "


def markdown(result: dict) -> str:
    s, an = result["suite"], result["analysis"]
    sweep = ", ".join(f"x{m}: {r['final_val_loss']:.4f}" for m, r in result["sweep"].items())
    budgets = ", ".join(f"{b:g}" for b in s["budgets"])
    lines = [f"Suite `{s['name']}`: {s['doc']}. Model `{s['model']}`, {s['steps']} steps of {s['seq_len']}-byte "
             f"sequences at the full budget, budgets {budgets} of it (each with its own full warmup-cosine "
             f"schedule), seeds {', '.join(map(str, s['seeds']))}. Plain DeepSpeed's LR sweep at the full budget: "
             f"{sweep}{_tie_break(result)} (x{result['best_lr_multiplier']:g} = lr {result['best_lr']:g}); "
             f"{_own_lrs(result)}"
             f"Targets per seed: plain DeepSpeed's final validation loss at the full budget, and 1% and 2% above it. "
             f"Ratio = the system's least time to reach the target at any budget over plain DeepSpeed's "
             f"(`ds_hybrid/frontier.py`); under 1 is faster."
             + (f" The runs ran {result['jobs']} at a time (`--jobs`), each bound to its own share of the cores: "
                "they shared the machine's memory bandwidth (and GPU), so their seconds, and the ratios in seconds "
                "below, are not a clean time; read the Full-step equivalents (each step kind timed alone, in one "
                "process, after the runs)." if concurrent(result) else ""), ""]
    lines += ["| system | target | target +1% | target +2% | Full-step equivalents: target / +1% / +2% | "
              "full budget: final val gap | full budget: time | backward skipped: whole + partial |",
              "|---|---|---|---|---|---|---|---|"]
    for name, a in an["arms"].items():
        g = a["aggregate"]
        sec, eq, fb = g["seconds"], g["equivalents"], g.get("full_budget", {})
        eqs = " / ".join(_ms(eq[t], "{:.3f}") if eq[t]["reached"] else "-" for t in ("target", "target+1%",
                                                                                        "target+2%"))
        skipped = (f"{_ms(fb.get('backward_skipped'), '{:.0f}')} + {_ms(fb.get('partial_backward'), '{:.0f}')}"
                   if fb else "-")
        lines.append(f"| `{name}` | {_ratio_cell(sec['target'])} | {_ratio_cell(sec['target+1%'])} | "
                     f"{_ratio_cell(sec['target+2%'])} | {eqs} | {_ms(fb.get('final_gap_pct'), '{:+.2f}')}% | "
                     f"{_ms(fb.get('time_ratio'), '{:.3f}')}x | {skipped} |")
    for name, err in result.get("errors", {}).items():
        lines.append(f"| `{name}` | did not run: {err} | | | | | | |")
    bands = [(n, a["aggregate"]["equivalents_profile_band"]["target+1%"]) for n, a in an["arms"].items()
             if "equivalents_profile_band" in a["aggregate"]]
    if bands:
        lines += ["", "The Full-step equivalents at the target +1% with every step kind's cost one standard error "
                  "of the profile's rounds lower / higher (the seeds' spread aside; a floor on the profile's "
                  "uncertainty: profiles of other sittings differ by more): "
                  + "; ".join(f"`{n}` {_f(lo, '{:.3f}')} / {_f(hi, '{:.3f}')}" for n, (lo, hi) in bands) + "."]
    for unit, text in (("optimizer_steps", "Optimizer steps to reach the target +1% (every step but a Predict step: "
                         "under ZeRO-Offload the CPU Adam steps and their PCIe copies), over plain DeepSpeed's: "),
                       ("sequences", "Sequences whose gradient the steps took to reach the target +1% (a real step its "
                        "whole batch, a Predict step its share: `predictor.gradient_batch_fraction`, none for a drift "
                        "one), over plain DeepSpeed's; about 1 where the steps were worth their sequences and the time "
                        "saved is each sequence's cost, under 1 where the steps were worth more: ")):
        got = [(n, a["aggregate"][unit]["target+1%"]) for n, a in an["arms"].items() if unit in a["aggregate"]]
        if got:   # (older results: no such unit)
            lines += ["", text + "; ".join(f"`{n}` {_ratio_cell(o)}" for n, o in got) + "."]
    unit = lead_unit(result)
    for v in plain_variants(result):
        rows = [(n, over_arm(result, n, v, unit)) for n, a in result["arms"].items()
                if n in an["arms"] and a.get("hybrid") is not None and not ds_feature(a.get("hybrid"))]
        if rows:
            def timed(n: str) -> str:
                # (in seconds: the same in Full-step equivalents, where the profile priced both arms, and
                # whether the machine timed the two arms' same work alike)
                parts = []
                e = over_arm(result, n, v, "equivalents") if unit == "seconds" and result.get("profile") else None
                if e and e["reached"]:
                    parts.append(f"{_ratio_cell(e)} in Full-step equivalents")
                w = same_work(result, n, v) if unit == "seconds" else None
                if w:
                    parts.append(f"its real steps' plain work timed {_ms(w, '{:.2f}')}x `{v}`'s")
                return f" ({'; '.join(parts)})" if parts else ""
            lines += ["", f"Time to the target +1% over `{v}`'s (per seed, the same targets; the plain DeepSpeed a "
                      "hybrid is to beat where that arm is the faster plain; in brackets the same in Full-step "
                      "equivalents where the profile priced both arms, and the forward, backward and "
                      "optimizer step inside the two arms' real steps, DeepSpeed's timers, one over the other: about 1 "
                      "where the machine timed the same work alike, under 1 where the seconds flatter the hybrid): "
                      + "; ".join(f"`{n}` {_ratio_cell(o)}{timed(n)}" for n, o in rows) + "."]
    lines += ["", "Systems:", ""]
    for name, arm in result["arms"].items():
        lines.append(f"- `{name}`: {arm['doc']}.")
    lines += ["", "Frontier points (mean over seeds: training seconds, final validation loss):", "",
              "| system | " + " | ".join(f"budget {b:g}" for b in s["budgets"]) + " |",
              "|---|" + "---|" * len(s["budgets"])]
    for arm, by_seed in result["runs"].items():
        cells = []
        for b in s["budgets"]:
            pts = [r[f"{b:g}"] for r in by_seed.values() if f"{b:g}" in r]
            cells.append(f"{statistics.mean(p['train_seconds'] for p in pts):.1f} s, "
                         f"{statistics.mean(p['final_val_loss'] for p in pts):.4f}" if pts else "-")
        lines.append(f"| `{arm}` | " + " | ".join(cells) + " |")
    lines += ["", "Per seed (ratio of times to the target, seconds; Full-step equivalents in brackets):", "",
              "| system | seed | target loss | target | +1% | +2% | full-budget final val (plain) |",
              "|---|---|---|---|---|---|---|"]
    for name, a in an["arms"].items():
        for seed, p in a["per_seed"].items():
            r = p["seconds"]
            e = p["equivalents"]
            cells = [f"{_f(r[t]['ratio'])} ({_f(e[t]['ratio'])})" for t in ("target", "target+1%", "target+2%")]
            fb = p["full_budget"] or {}
            lines.append(f"| `{name}` | {seed} | {r['target']['target']:.4f} | " + " | ".join(cells) +
                         f" | {_f(fb.get('final_val_loss'), '{:.4f}')} ({_f(fb.get('baseline_final_val_loss'), '{:.4f}')}) |")
    lines += judgement_table(result)
    lines += wall_clock_table(result)
    prof = result.get("profile")
    if prof:
        unpaired = prof.get("unpaired_cost", {})
        before = prof.get("rounds_before") or 0
        se = prof.get("cost_se") or {}   # (older profiles: none)
        lines += ["", f"Step kinds (one process, mean of {prof['reps']} steps"
                  + (f", {before} of them timed by an earlier invocation (its saved rounds, `--reuse`: a profile "
                     "cut off goes on from them)" if before else "")
                  + "; cost in plain DeepSpeed real steps" + (", ± one standard error over the rounds" if se else "")
                  + ("; a hybrid real step's cost is its time over the plain forward, backward and step inside it, "
                     "the same steps' time over the plain steps' beside it" if unpaired else "") + "):",
                  "", "| step kind | ms | cost |", "|---|---|---|"]
        for kind, sec in prof["seconds"].items():
            share = prof.get("partial_share", {}).get(kind)
            label = kind + (f" (backward skipped for {100 * share:.0f}% of the parameters)" if share else
                            " (DeepSpeed's own engine, no ds_hybrid code)" if kind == "deepspeed" else
                            KIND_LABELS[kind] if kind in KIND_LABELS else
                            (" (plain DeepSpeed with this system's config, stepped as its runs were, at its own LR)"
                             if prof.get("feature_engine") == "ds_hybrid" else   # (older profiles: DeepSpeed's own)
                             " (DeepSpeed's engine with this system's config, at its own LR)")
                            if ds_feature(result["arms"].get(kind, {}).get("hybrid")) else "")
            beside = f" ({unpaired[kind]:.3f})" if kind in unpaired else ""
            error = f" ± {se[kind]:.3f}" if se.get(kind) else ""
            lines.append(f"| {label} | {sec * 1e3:.1f} | {prof['cost'][kind]:.3f}{error}{beside} |")
        lines += elsewhere_lines(prof)
    return "\n".join(lines)


def _changes(ds_changes: dict) -> str:
    """A DeepSpeed config change in words: ``{"activation_checkpointing": None}`` is
    "`activation_checkpointing` removed"."""
    return ", ".join(f"`{k}` removed" if v is None else f"`{k}`: `{json.dumps(v)}`" for k, v in ds_changes.items())


def elsewhere_lines(prof: dict) -> list[str]:
    """The profiles of the hybrid arms that ran on a changed DeepSpeed config (``bench.elsewhere_profiles``):
    each kind their runs took, timed on that config, in the suite's plain steps."""
    by_config: dict[str, list[str]] = {}
    for arm, sub in (prof.get("elsewhere") or {}).items():
        by_config.setdefault(json.dumps(sub["ds_changes"], sort_keys=True), []).append(arm)
    lines = []
    for arms in by_config.values():
        sub = prof["elsewhere"][arms[0]]
        se = sub.get("cost_se") or {}
        costs = "; ".join(f"{k} {c:.3f}" + (f" ± {se[k]:.3f}" if se.get(k) else "")
                          for k, c in sub["cost"].items() if k not in ("suite_plain", "plain", "deepspeed"))
        lines += ["", f"{', '.join(f'`{a}`' for a in arms)}: its step kinds timed on its own DeepSpeed config "
                  f"({_changes(sub['ds_changes'])}), beside the suite's plain step (the unit) in {sub['reps']} rounds "
                  f"of one process after the profile above: {costs}; that config's plain step "
                  f"{sub['cost']['plain']:.3f}" + (f" ± {se['plain']:.3f}" if se.get("plain") else "") + "."]
    return lines


# What a profiled kind is, where its name does not say it.
KIND_LABELS = {
    "real_gradient": " (a real step of an engine with predictor.direction: gradient: no velocity, no probe)",
    "predict_run": " (a drift step that begins a run: the velocity copied beside the GPU's weights)",
    "real_commit": " (a real step after a kept drift run on the device path: the run's masters catch up)",
}


def wall_clock_table(result: dict) -> list[str]:
    """Where a real step's time goes, per system: DeepSpeed's own timers and the engine's step time."""
    wc = result["analysis"].get("wall_clock")
    if not wc:
        return []
    launcher = result["suite"].get("launcher", "python")
    how = ("every run started by DeepSpeed's launcher with `--bind_cores_to_rank`" if launcher == "deepspeed"
           else "every run its own Python process")
    lines = ["", f"Real steps at the full budget ({how}; mean ± std over seeds, ms per step): DeepSpeed's "
             "`wall_clock_breakdown` timers, booked per kind of step (`ds_hybrid/wall_clock.py`), and the engine's "
             "whole `train_step`, which adds what runs around them (the hybrid's bookkeeping, the rank agreement, "
             "the data copy):", "",
             "| system | forward | backward | optimizer step | whole real step | over plain DeepSpeed's, same seed | "
             "Predict step |", "|---|---|---|---|---|---|---|"]
    for arm, w in wc.items():
        t = w["timers_ms"]
        ratio = "1" if arm == "baseline" else f"{_ms(w['real_step_ratio'], '{:.3f}')}x"
        lines.append(f"| `{arm}` | {_ms(t['fwd'], '{:.1f}')} | {_ms(t['bwd'], '{:.1f}')} | "
                     f"{_ms(t['step'], '{:.1f}')} | {_ms(w['real_step_ms'], '{:.1f}')} | {ratio} | "
                     f"{_ms(w['predict_step_ms'], '{:.2f}')} |")
    return lines


def judgement_table(result: dict, arm: str = "predict", control: str = "predict-skip") -> list[str]:
    """Does what the check accepts pay off? The same runs with the Predict steps taken against
    skipped (same schedule, same real steps): a lower final loss means the accepted runs paid."""
    runs = result["runs"]
    if arm not in runs or control not in runs:
        return []
    lines = ["", f"What the check accepted, against its control (`{arm}` minus `{control}`: the same schedule and "
             f"real steps, the Predict steps skipped; negative = the taken steps paid off):", "",
             "| budget | seed | final val | control final val | difference | Predict steps accepted / rolled back |",
             "|---|---|---|---|---|---|"]
    diffs = []
    for seed, by_budget in runs[arm].items():
        for b, row in by_budget.items():
            ctl = runs[control].get(seed, {}).get(b)
            if ctl is None:
                continue
            d = row["final_val_loss"] - ctl["final_val_loss"]
            diffs.append(d)
            st = row.get("statistics") or {}
            lines.append(f"| {b} | {seed} | {row['final_val_loss']:.4f} | {ctl['final_val_loss']:.4f} | {d:+.4f} | "
                         f"{st.get('predict_accepted')} / {st.get('predict_rolled_back')} |")
    if diffs:
        lines.append(f"| all | | | | {statistics.mean(diffs):+.4f} (negative in {sum(d < 0 for d in diffs)} of "
                     f"{len(diffs)}) | |")
    return lines


def _comparators(result: dict, unit: str = "seconds") -> str:
    """DeepSpeed's own alternatives in the suite (arms that are a DeepSpeed feature, no hybrid, such
    as ZenFlow): their ratio to 1% above plain DeepSpeed's final loss, for the headline."""
    parts = []
    for name, arm in result["arms"].items():
        hybrid = arm.get("hybrid")
        if not ds_feature(hybrid) or name not in result["analysis"]["arms"]:
            continue
        a = result["analysis"]["arms"][name]["aggregate"][unit]["target+1%"]
        if a["reached"] == a["seeds"] and a["mean"] is not None:
            parts.append(f"`{name}` reaches 1% above plain DeepSpeed's final loss in {_ms(a, '{:.2f}')}x its time")
        else:
            parts.append(f"`{name}` reaches 1% above it on {a['reached']} of {a['seeds']} seeds")
    return ("; " + ", ".join(parts)) if parts else ""


def plain_variants(result: dict) -> list[str]:
    """The suite's other plain DeepSpeed arms (a DeepSpeed config change, no hybrid, named
    ``baseline-*``: plain without the recompute), against which a hybrid's time is read too."""
    return [n for n, a in result["arms"].items() if n.startswith("baseline-") and ds_feature(a.get("hybrid"))
            and n in result["analysis"]["arms"]]


def over_arm(result: dict, arm: str, other: str, unit: str, target: str = "target+1%") -> dict:
    """Per seed, ``arm``'s time to the target over ``other``'s (both on the frontier, the same
    targets), mean and spread over the seeds where both reached it."""
    arms = result["analysis"]["arms"]
    mine, theirs = arms[arm]["per_seed"], arms[other]["per_seed"]
    vals = []
    for seed, p in mine.items():
        a, b = p[unit][target]["time"], theirs.get(seed, {}).get(unit, {}).get(target, {}).get("time")
        vals.append(a / b if a is not None and b else None)
    reached = [v for v in vals if v is not None]
    return dict(fr.mean_spread(reached), reached=len(reached), seeds=len(vals))


def same_work(result: dict, arm: str, other: str) -> dict | None:
    """Per seed, the plain work inside ``arm``'s real steps (DeepSpeed's ``wall_clock_breakdown``:
    forward, backward and optimizer step, the same work in either arm's real step) over ``other``'s,
    each the mean over its runs: about 1 where the two were timed alike, under 1 where the machine
    ran ``arm``'s runs faster and their seconds flatter it. None where the two ran different
    DeepSpeed configs (a plain arm's ``__ds__`` change not the hybrid's ``ds_changes``: not the same
    work) or without the timers."""
    arms = result["arms"]
    config = {n: arms[n].get("ds_changes") or (arms[n]["hybrid"]["__ds__"] if ds_feature(arms[n].get("hybrid"))
                                                 else None) or {} for n in (arm, other)}
    if config[arm] != config[other]:
        return None

    def plain_ms(by_budget: dict) -> float | None:
        ms = [sum(t["mean_ms"].get(k, 0.0) for k in ("fwd", "bwd", "step"))
              for t in (((row.get("statistics") or {}).get("wall_clock_breakdown") or {}).get("real")
                        for row in by_budget.values()) if t]   # (older runs: no timers)
        return sum(ms) / len(ms) if ms else None
    runs = result.get("runs", {})
    vals = []
    for seed, by_budget in runs.get(arm, {}).items():
        a, b = plain_ms(by_budget), plain_ms(runs.get(other, {}).get(seed, {}))
        if a and b:
            vals.append(a / b)
    return fr.mean_spread(vals) if vals else None


def concurrent(result: dict) -> bool:
    """Whether the runs ran several at a time (``--jobs``): their seconds then share the machine,
    and the ratios to read are the Full-step equivalents."""
    return result.get("jobs", 1) > 1


def headline(result: dict) -> str:
    """The README opening's sentence for this suite, whatever the result. Its ratio is in seconds,
    or, where the runs ran several at a time (``--jobs``), in Full-step equivalents (each step
    kind timed alone), the other unit beside it."""
    s = result["suite"]
    lead = lead_unit(result)
    best = best_arm(result, unit=lead)
    seeds = len(s["seeds"])
    if best is None:
        return (f"- `{s['name']}` ({s['model']}, {seeds} seeds): no hybrid system reached 1% above plain "
                f"DeepSpeed's final validation loss on every seed{_comparators(result, lead)}.")
    name, a = best
    an = result["analysis"]["arms"][name]["aggregate"]
    t0 = an[lead]["target"]
    at_target = (f"{_ms(t0, '{:.2f}')}x at the target itself" if t0["reached"] == t0["seeds"]
                 else f"the target itself on {t0['reached']} of {t0['seeds']} seeds")
    if concurrent(result):
        other = (f"in Full-step equivalents (each step kind timed alone, in one process; "
                 f"{_ms(an['seconds']['target+1%'], '{:.2f}')}x in the seconds of runs that ran {result['jobs']} at "
                 "a time, each on its own cores)")
    else:
        other = (f"({_ms(an['equivalents']['target+1%'], '{:.2f}')}x in Full-step equivalents, from a profile of "
                 "the step kinds in one process)")
    d = result["analysis"]["arms"].get("default", {}).get("aggregate", {}).get("full_budget", {})
    # The default's time in Full-step equivalents first: its seconds share a sitting with plain
    # DeepSpeed's only when neither was reused (--reuse) nor ran beside other runs (--jobs), and
    # the equivalents never depend on it.
    default = ""
    if d:
        seconds = ("seconds not comparable: runs reused from another sitting" if result.get("reused_runs") else
                   f"seconds not comparable: runs ran {result['jobs']} at a time" if concurrent(result) else
                   f"{_ms(d.get('time_ratio'), '{:.3f}')}x in seconds")
        time = (f"{_ms(d.get('equivalents_ratio'), '{:.3f}')}x its Full-step equivalents ({seconds})"
                if (d.get("equivalents_ratio") or {}).get("n") else f"{_ms(d.get('time_ratio'), '{:.3f}')}x its time")
        default = (f"; the default preset ends {_ms(d.get('final_gap_pct'), '{:+.2f}')}% from plain DeepSpeed's "
                   f"final loss in {time}")
    return (f"- `{s['name']}` ({s['model']}, {seeds} seeds): best hybrid system `{name}` reaches 1% above plain "
            f"DeepSpeed's final validation loss in **{_ms(a, '{:.2f}')}x** plain DeepSpeed's time on its budget "
            f"frontier {other}, {at_target}{default}{_comparators(result, lead)}.")


def plot(result: dict, path: Path) -> None:
    """Validation loss against training time: one point per budget, system and seed, the
    per-budget means joined."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colours = ["black", "tab:green", "tab:olive", "tab:blue", "tab:cyan", "tab:purple", "tab:red", "tab:brown"]
    budgets = result["suite"]["budgets"]
    for i, (arm, by_seed) in enumerate(result["runs"].items()):
        colour = colours[i % len(colours)]
        xs, ys = [], []
        for b in budgets:
            pts = [r[f"{b:g}"] for r in by_seed.values() if f"{b:g}" in r]
            if not pts:
                continue
            ax.scatter([p["train_seconds"] for p in pts], [p["final_val_loss"] for p in pts], color=colour,
                       s=12, alpha=0.5)
            xs.append(statistics.mean(p["train_seconds"] for p in pts))
            ys.append(statistics.mean(p["final_val_loss"] for p in pts))
        ax.plot(xs, ys, color=colour, marker="o", lw=1.5, label=arm)
    targets = [t["target"] for t in result["analysis"]["targets"].values()]
    if targets:
        ax.axhline(statistics.mean(targets), color="grey", ls="--", lw=1, label="target (plain, full budget)")
        ax.axhline(statistics.mean(targets) * 1.01, color="grey", ls=":", lw=1, label="target +1%")
    ax.set_xlabel("training seconds (evaluation excluded)")
    ax.set_ylabel("final validation loss")
    ax.set_title(f"{result['suite']['name']} ({result['suite']['model']}): budget frontier")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)


def _took(seconds: float) -> str:
    """The runs' time (the profile not included): seconds where every run was reused."""
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def readme_section(result: dict, name: str) -> str:
    """The suite's section of docs/benchmarks.md (its links relative to docs/)."""
    s = result["suite"]
    return "\n".join([
        f"### `{s['name']}`" + (f" with `{s['model']}`" if result.get("variant") else ""), "",
        f"Command: `.venv/bin/{result['command']}` (took {_took(result['bench_seconds'])} on "
        f"{result['host']}, {result.get('date', '')}"
        + (f"; {result['reused_runs']} runs reused from an earlier sitting" if result.get("reused_runs") else "")
        + (f"; {result['reprofiled']}" if result.get("reprofiled") else "") + "). Source of every number below: "
        f"[`docs/results/{name}.json`](results/{name}.json); regenerate this section with "
        f"`.venv/bin/ds-hybrid bench --from-json docs/results/{name}.json --readme`.", "",
        markdown(result), "",
        f"![validation loss against training time, budget frontier](results/{name}.png)",
    ])


def result_name(result: dict) -> str:
    """The file and README-marker name of a result: the suite, plus the model where it is not the suite's."""
    s = result["suite"]
    default_model = SUITES[s["name"]].model if s["name"] in SUITES else s["model"]
    return s["name"] if s["model"] == default_model else f"{s['name']}-{s['model']}"


def _replace_between(text: str, start: str, end: str, body: str, where: str) -> str:
    if start not in text or end not in text:
        raise SystemExit(f"{where}: no markers {start} ... {end}")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def offload_table(results: dict[str, dict | None]) -> str:
    """The README's table of the ZeRO-Offload suites (``OFFLOAD_SUITES``, each a saved result or
    None where not run): plain ZeRO-Offload, DeepSpeed's alternatives (ZenFlow) and the best hybrid
    system, each one's time to 1% above plain's final loss over plain's."""
    lines = ["Under ZeRO-Offload (`offload_optimizer: cpu`): the time to reach 1% above plain ZeRO-Offload's final "
             "validation loss over plain's (LR-tuned, budget frontier, mean ± std over 3 seeds; in seconds, or in "
             "Full-step equivalents where a suite's runs ran several at a time; under 1 is sooner). A row: `ds-hybrid "
             "bench --suite NAME`, its section in [Benchmarks](docs/benchmarks.md) and `docs/results/NAME.json`.", "",
             "| suite | plain ZeRO-Offload | DeepSpeed's alternatives (ZenFlow) | best hybrid system | at the target itself "
             "| its optimizer steps |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        suite = SUITES[name]
        cell = f"[`{name}`](docs/benchmarks.md#{name}) ({suite.model}"
        if r is None:
            lines.append(f"| {cell}) | not run yet" + (", needs a CUDA GPU: `bash benchmarks/gpu_run.sh OUT ops "
                                                    "offbench`" if suite.needs_gpu else "") + " | | | | |")
            continue
        unit = lead_unit(r)
        cell += f", {r['host']}, {r.get('date', '')}" + (", Full-step equivalents" if concurrent(r) else "") + ")"
        arms = r["analysis"]["arms"]
        features = [n for n, a in r["arms"].items() if ds_feature(a.get("hybrid")) and n in arms]
        own = r.get("own_lr") or {}
        zen = "; ".join(f"`{n}` {_ratio_cell(arms[n]['aggregate'][unit]['target+1%'], '{:.2f}', 'x')} "
                        + ("(its own LR swept)" if n in own else "(at plain's LR)") for n in features) \
            or "not in the suite"
        # (where no system reached it on every seed, the one that did on the most, its seeds counted)
        best = best_arm(r, unit=unit, every_seed=False)
        if best is None:
            hybrid = target = steps = "none reached it on every seed"
        else:
            agg = arms[best[0]]["aggregate"]
            hybrid = ("none on every seed; " if best[1]["reached"] < best[1]["seeds"] else "") \
                + f"`{best[0]}` **{_ratio_cell(best[1], '{:.2f}', 'x')}**" + "".join(
                f" ({_ratio_cell(over_arm(r, best[0], v, unit), '{:.2f}', 'x')} `{v}`'s)" for v in plain_variants(r))
            target = _ratio_cell(agg[unit]["target"], "{:.2f}", "x")
            steps = _ratio_cell(agg["optimizer_steps"]["target+1%"], "{:.2f}", "x") if "optimizer_steps" in agg else "-"
        lines.append(f"| {cell} | 1 | {zen} | {hybrid} | {target} | {steps} |")
    return "\n".join(lines)


def _offload_results(result: dict, name: str, repo_root: Path) -> dict[str, dict | None]:
    """Every offload suite's saved result, ``result`` in place of its own."""
    out = {}
    for suite in OFFLOAD_SUITES:
        path = repo_root / "docs" / "results" / f"{suite}.json"
        out[suite] = result if suite == name else json.loads(path.read_text()) if path.is_file() else None
    return out


def not_reportable(seeds, quick: bool) -> str | None:
    """Why a bench result may not go into the README and docs/benchmarks.md (None: it may):
    they report ratios over 3 seeds or more of a suite as it is, never a smoke run's."""
    if quick:
        return "a --quick run is a smoke test of the bench (a test model, a few steps)"
    if len(seeds) < 3:
        return f"{len(seeds)} seeds ({', '.join(map(str, seeds))}): a reported ratio needs 3 or more (--seeds)"
    return None


def update_readme(result: dict, repo_root: Path) -> tuple[Path, Path]:
    """Copy the result into docs/results/, rewrite its section of docs/benchmarks.md and its
    headline line in README.md (an offload suite's: the offload table). Both files are checked for
    their markers before either is written."""
    why = not_reportable(result["suite"]["seeds"], result.get("quick", False))
    if why:
        raise SystemExit(f"--readme: {why}; README.md and docs/ are unchanged")
    readme, sections = repo_root / "README.md", repo_root / "docs" / "benchmarks.md"
    name = result_name(result)
    result = dict(result, variant=name != result["suite"]["name"])
    text = _replace_between(sections.read_text(), README_MARK.format(name=name, end="start"),
                            README_MARK.format(name=name, end="end"), readme_section(result, name), str(sections))
    if name in OFFLOAD_SUITES:
        head = _replace_between(readme.read_text(), OFFLOAD_MARK.format(end="start"), OFFLOAD_MARK.format(end="end"),
                                offload_table(_offload_results(result, name, repo_root)), str(readme))
    else:
        head = _replace_between(readme.read_text(), HEADLINE_MARK.format(name=name, end="start"),
                                HEADLINE_MARK.format(name=name, end="end"), headline(result), str(readme))
    dest = repo_root / "docs" / "results"
    dest.mkdir(parents=True, exist_ok=True)
    json_path, png_path = dest / f"{name}.json", dest / f"{name}.png"
    if Path(result["json_path"]).resolve() != json_path.resolve():
        shutil.copyfile(result["json_path"], json_path)
    if result.get("png_path") and Path(result["png_path"]).is_file() \
            and Path(result["png_path"]).resolve() != png_path.resolve():
        shutil.copyfile(result["png_path"], png_path)
    sections.write_text(text)
    readme.write_text(head)
    return readme, sections
