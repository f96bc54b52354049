"""A failed rank in words: the exit codes hdet-train's ranks use for what is not their
own crash (a lost gloo peer, a DeepSpeed op build that ended without the op or was
stopped), gloo's error in a few words, and the one line the launchers print for the
failed ranks (``launcher.launch_local``, ``launchers/torchrun_quiet.py``). Pure."""

from __future__ import annotations

import re
import signal

PEER_LOST = 4  # a rank's exit code (the launcher's own is 1) when gloo lost a peer: peer_lost()
OP_MISSING = 5  # a rank's exit code when the op build it waited on ended without the op: op_missing()
BUILD_STOPPED = 128 + signal.SIGINT  # a rank's exit code when a signal stopped its op build's ninja


def peer_lost(e: BaseException) -> bool:
    """Whether ``e`` is gloo's error for a peer rank that went away (its connection reset
    or closed in the middle of a collective), not a failure of this rank's own."""
    text = str(e)
    return "gloo" in text and any(k in text for k in (
        "Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket closed"))


def gloo_reason(e: BaseException) -> str:
    """gloo's error in a few words: its first sentence without the source location
    (``[.../pair.cc:537] Read error [127.0.0.1]:2455: Connection reset by peer. This is
    typically caused by ...`` -> ``Read error [127.0.0.1]:2455: Connection reset by
    peer``, not cut mid-word at 200 characters)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", text)
    text = text.split(". ")[0].rstrip(".")
    return text if len(text) <= 200 else text[:200].rsplit(" ", 1)[0] + " ..."


def describe_failures(failed: dict[int, int], hint: bool = True) -> str:
    """``{rank: Process.exitcode}`` of the ranks that failed, in words: a negative code is
    the signal that killed the rank (the out-of-memory killer's SIGKILL, most often), a
    positive one its exit status. The ranks the first failure took down are listed after
    it. ``hint``: add what a SIGKILL most often is."""
    def one(code: int) -> str:
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name} (signal {-code})"
            except ValueError:
                return f"killed by signal {-code}"
        if code == PEER_LOST:
            return "lost the connection to a rank that ended"
        if code == OP_MISSING:
            return "found no DeepSpeed op after waiting on another rank's build of it (that build was stopped or failed)"
        if code == BUILD_STOPPED:
            return "had its DeepSpeed op build (ninja) stopped by a signal"
        return f"exit code {code}"

    by_kind: dict[str, list[int]] = {}
    for rank, code in sorted(failed.items()):
        by_kind.setdefault(one(code), []).append(rank)
    # the causes first (a kill, a stopped build), the ranks they took down after
    causes = [k for k in by_kind if k.startswith("killed") or k == one(BUILD_STOPPED)]
    parts = [f"rank(s) {ranks} {kind}" for kind, ranks in sorted(by_kind.items(), key=lambda kv: kv[0] not in causes)]
    why = ("; a rank killed by SIGKILL is often the out-of-memory killer's work (see dmesg), "
            "or a kill -9" if "killed by SIGKILL (signal 9)" in by_kind else "")
    if set(failed.values()) == {PEER_LOST}:  # none ended first: the connections themselves failed
        why += " (no rank ended first: a network failure between the ranks?)"
    return "failed: " + ", ".join(parts) + (why if hint else "")
