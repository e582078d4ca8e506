"""The demo's progress bar: what is said while it is drawn (the eviction, its CLI output, a failed
request) goes on lines of its own above it, never over it or into it."""

from __future__ import annotations

from dataplane.ops.demo import Progress


def screen(out: str) -> list[str]:
    """The lines a terminal shows for `out` (a carriage return rewrites the current line)."""
    lines = [""]
    for chunk in out.replace("\r", "\x00\r").split("\n"):
        cur = ""
        for piece in chunk.split("\x00"):
            if piece.startswith("\r"):
                piece = piece[1:]
                cur = piece + cur[len(piece):]
            else:
                cur += piece
        lines[-1] = cur
        lines.append("")
    return [ln.rstrip() for ln in lines if ln.strip()]


def test_what_is_said_while_the_bar_runs_keeps_its_own_lines(capsys) -> None:
    bar = Progress(8, "burst 2")
    bar.tty = True
    for _ in range(3):
        bar.update(ok=True)
    bar.say("  (evicting replica 0 while requests flow)")
    bar.say("$ ndif evict gpt2 --replica-id 0")
    bar.say("  evicted replica 0")
    for _ in range(5):
        bar.update(ok=True)
    shown = screen(capsys.readouterr().out)
    assert shown[:3] == ["  (evicting replica 0 while requests flow)", "$ ndif evict gpt2 --replica-id 0",
                         "  evicted replica 0"], shown
    assert len(shown) == 4 and shown[3].startswith("  burst 2 [") and "8/8 done" in shown[3], shown
