"""The floors under capsvc / bare: a one-grid sale cut short at each step, side by side.

    python bench/cuts.py [--rev REV] [--cuts auth,validated,...] [bench/ab.py's options]

Builds throwaway trees of REV (default HEAD), each a git worktree whose sale answers a
constant body at one step, then runs bench/ab.py on REV and those trees (each on its own
redis-server, pinned to CPU 0, rounds alternating, the bare handler beside them). A step's
cost is the difference between two cuts in server CPU a ticket (`cpu µs/t`); `/ bare` is
the ratio to the bare handler in the same run.

The cuts (lines patched into capsvc/service/tickets.py and capsvc/redis/store.py; the script
stops if the code they anchor on has changed):

    auth        after authentication and the body's decoding
    validated   after the ticket is validated (rules, fingerprint) and named
    ping        validated, then one PING through the coalescer
    journal     validated, then one journal record of the sale's size, waited until durable
    floor       validated, a PING and a durable journal record: the least a journaled
                sale can do
    args        the sale call's keys and arguments built, a PING sent instead of it
    called      the sale's own call (capsvc_sell) made, its reply not read
    decided     the decision built from the reply and encoded, not journaled

Prints what bench/ab.py prints; asserts nothing. Removes its trees when done.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CONST = "b'{\"ticket_id\":\"x\",\"status\":\"accepted\"}'"
ANSWER = "return SaleOutcome(body=_CONST, replayed=False)"

VALIDATE = """        game = self.catalog.game(t.game, channel, "sell")
        sale = validate_ticket(game.rules, t)
        key = ticket_key(channel.id, t.ticket_id)
"""
CLAIMED = """            if isinstance(claim, Refused):
"""
DECIDED = """                body = _encode(out)
                await self._journaled(key, claim.sale_id, b"f", self.journal.sale(
"""
CALL = """        args += (*expiries, time_zone, "fix" if fix_caps else "", sale_nonce)
"""
PING = '        await self.store.redis.call("PING")\n'
RECORD = ("        first = sale.first_draw or game.calendar.current(self.clock.now())\n"
          "        stored = msgspec.structs.replace(sale, first_draw=first)\n"
          "        await self.journal.sale(\"answer\", channel.id, stored, "
          "\"00000000000000ab\", 1, _CONST, 1)\n")


def validated_then(*steps: str) -> dict[str, dict[str, tuple[str, str]]]:
    """A cut after validation: `steps`, then the constant answer."""
    return {"capsvc/service/tickets.py": {
        VALIDATE: (VALIDATE, "".join(steps) + f"        {ANSWER}\n")}}


CUTS: dict[str, dict[str, dict[str, tuple[str, str]]]] = {
    "auth": {"capsvc/service/tickets.py": {VALIDATE: ("", f"        {ANSWER}\n")}},
    "validated": validated_then(),
    "ping": validated_then(PING),
    "journal": validated_then(RECORD),
    "floor": validated_then(PING, RECORD),
    "args": {"capsvc/service/tickets.py": {CLAIMED: ("", f"            {ANSWER}\n")},
             "capsvc/redis/store.py": {
                 CALL: (CALL, "        return self.redis.submit(\"PING\")\n")}},
    "called": {"capsvc/service/tickets.py": {CLAIMED: ("", f"            {ANSWER}\n")}},
    "decided": {"capsvc/service/tickets.py": {DECIDED: ("                body = _encode(out)\n",
                                                "                return SaleOutcome("
                                                "body=body, replayed=False)\n")}},
}
"""Per cut, per file, per anchor: (what the anchor keeps before the cut's lines, the
lines). An anchor kept whole comes first; an empty keep puts the lines before it."""


def patch(tree: Path, edits: dict[str, dict[str, tuple[str, str]]]) -> None:
    for name, anchors in edits.items():
        path = tree / name
        text = path.read_text()
        for anchor, (keep, lines) in anchors.items():
            if text.count(anchor) != 1:
                raise SystemExit(f"{name} changed: the cut's anchor is not found once:\n{anchor}")
            replacement = keep + lines + anchor[len(keep):] if keep else lines + anchor
            text = text.replace(anchor, replacement)
        if name == "capsvc/service/tickets.py":
            text = text.replace("_ATTEMPTS = 4\n", f"_ATTEMPTS = 4\n_CONST = {CONST}\n", 1)
        path.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rev", default="HEAD")
    parser.add_argument("--cuts", default="auth,validated,journal,floor,args,decided",
                        help=f"a comma-separated list of {', '.join(CUTS)}")
    args, rest = parser.parse_known_args()
    cuts = [c for c in args.cuts.split(",") if c]
    unknown = [c for c in cuts if c not in CUTS]
    if unknown:
        parser.error(f"no such cut: {', '.join(unknown)}")
    root = Path(tempfile.mkdtemp(prefix="cut-"))
    trees: list[Path] = []
    try:
        for cut in cuts:
            tree = root / cut
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach",
                            str(tree), args.rev], check=True)
            trees.append(tree)
            patch(tree, CUTS[cut])
            (tree / "capsvc" / "lua").symlink_to(tree / "lua", target_is_directory=True)
        return subprocess.run([sys.executable, str(HERE / "ab.py"), args.rev,
                               *map(str, trees), *rest]).returncode
    finally:
        for tree in trees:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                            str(tree)], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
