"""Which checkpoint ``inspect`` and ``export`` read: ``--step N``, ``--tag NAME`` or the newest.

Users name checkpoints by tag (``epoch-3``, Lightning's file name, DeepSpeed's ``global_step500``)
as often as by step: both are accepted, and with neither (or ``--step latest``) the newest
healthy step is read, as a restart would. The first tier (fastest first) holding a healthy copy
wins; damaged copies tried first are named on stderr.
"""

from __future__ import annotations

import argparse
from typing import Callable, TypeVar, Union

from nebula_ckpt.cli.common import commit_state, note, open_tiers
from nebula_ckpt.errors import NebulaError
from nebula_ckpt.format.commit import step_dirs
from nebula_ckpt.restore.open import read_main_manifest
from nebula_ckpt.storage.base import Storage
from nebula_ckpt.storage.urls import strip_credentials
from nebula_ckpt.tiers.base import Tier

T = TypeVar("T")

#: ``--step`` value that means the newest healthy step
LATEST = "latest"

Candidate = tuple[int, Tier, Storage]


def step_arg(text: str) -> Union[int, str]:
    """argparse type of ``--step``: a step number or ``latest``."""
    if text == LATEST:
        return LATEST
    try:
        step = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a step number nor 'latest'") from None
    if step < 0:
        raise argparse.ArgumentTypeError(f"{step} is not a step number (>= 0)")
    return step


def add_choice_arguments(sp: argparse.ArgumentParser) -> None:
    """``--step N|latest`` and ``--tag NAME`` (at most one; neither: the newest healthy step)."""
    which = sp.add_mutually_exclusive_group()
    which.add_argument("--step", type=step_arg, default=None, metavar="N|latest",
                       help="the step to read, or 'latest' (the default: the newest healthy step)")
    which.add_argument("--tag", default=None, metavar="NAME",
                       help="the newest healthy step saved with this tag (as `ls` shows it)")


def _asked(args: argparse.Namespace) -> str:
    if isinstance(args.step, int):
        return f"checkpoint of step {args.step}"
    if args.tag is not None:
        return f"checkpoint tagged {args.tag!r}"
    return "checkpoint"


def candidates(args: argparse.Namespace, tiers: list[tuple[Tier, Storage]]) -> tuple[list[Candidate], list[str]]:
    """The copies that may answer ``--step`` / ``--tag`` / latest, newest step first (a step's
    tiers fastest first), and the tags seen on the way (for the error when none matches)."""
    found: list[Candidate] = []
    tags: list[str] = []
    for tier, st in tiers:
        for step in step_dirs(st):
            if isinstance(args.step, int):
                if step == args.step:
                    found.append((step, tier, st))
            elif args.tag is not None:
                try:
                    tag = read_main_manifest(st, step, f"tier {tier.name} step {step}").tag
                except Exception:  # damaged: not found by its tag (ls and verify show it)
                    continue
                if tag == args.tag:
                    found.append((step, tier, st))
                elif tag is not None and tag not in tags:
                    tags.append(tag)
            elif commit_state(st, tier, step)[0]:
                found.append((step, tier, st))
    found.sort(key=lambda c: -c[0])  # stable: a step's tiers stay fastest first
    return found, tags


def open_chosen(args: argparse.Namespace, opener: Callable[[Storage, int, str], T]) -> T:
    """``opener(storage, step, where)`` of the first healthy copy of what the user asked for.

    Raises:
        NebulaError: nothing healthy answers, naming every copy tried and why, or the tags
            there are when none matches ``--tag``.
    """
    tiers = open_tiers(args.root, args.storage_options)
    found, tags = candidates(args, tiers)
    errors = []
    for step, tier, st in found:
        try:
            result = opener(st, step, f"tier {tier.name} step {step}")
        except Exception as e:
            errors.append(str(e))
            continue
        for skipped in errors:
            note(f"skipped (damaged): {skipped}")
        return result
    root = strip_credentials(args.root)
    if args.tag is not None and not found:
        raise NebulaError(f"no committed checkpoint tagged {args.tag!r} under {root}; tags there: {tags[-20:]}")
    if isinstance(args.step, int) and not found:
        steps = sorted({s for tier, st in tiers for s in step_dirs(st) if commit_state(st, tier, s)[0]})
        there = (f"committed steps there: {_steps_list(steps)}" if steps else "it holds no committed checkpoint")
        raise NebulaError(f"no checkpoint of step {args.step} under {root}; {there}")
    raise NebulaError(f"no healthy {_asked(args)} under {root}" + (f" ({'; '.join(errors)})" if errors else ""))


def _steps_list(steps: list[int]) -> str:
    """``1, 2, 5`` (a long list: its first three and its newest twenty, with the count)."""
    if len(steps) <= 24:
        return ", ".join(map(str, steps))
    return (f"{', '.join(map(str, steps[:3]))}, ... {', '.join(map(str, steps[-20:]))} "
            f"({len(steps)} in all)")
