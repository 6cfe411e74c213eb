"""`python -m evalkit` under torchrun with one rank made to fail at an exact moment, no clock involved:
`EVALKIT_TEST_FAIL=kill:<rank>:<n>` SIGKILLs that rank right after its n-th journal append;
`raise:<rank>:<n>` raises in that rank at its n-th decode step (the others then wait in a collective).
`EVALKIT_TEST_JOURNALED=<folder>`: every rank appends the key of each record it journals to
`<folder>/rank<r>` (which replica generated what)."""

import os
import signal
import sys
from pathlib import Path

import evalkit.engine as engine
import evalkit.journal as journal
from evalkit.run import main

how, rank, after = os.environ.get("EVALKIT_TEST_FAIL", "none:-1:0").split(":")
count = [0]
here = int(os.environ["RANK"])

if "EVALKIT_TEST_JOURNALED" in os.environ:
    noted = Path(os.environ["EVALKIT_TEST_JOURNALED"]) / f"rank{here}"
    plain_append = journal.Journal.append

    def noting_append(self, rec):
        plain_append(self, rec)
        with open(noted, "a") as f:
            f.write(rec["key"] + "\n")

    journal.Journal.append = noting_append

if here == int(rank) and how == "kill":
    append = journal.Journal.append

    def killing_append(self, rec):
        append(self, rec)
        count[0] += 1
        if count[0] == int(after):
            os.kill(os.getpid(), signal.SIGKILL)

    journal.Journal.append = killing_append

if here == int(rank) and how == "raise":
    step = engine.Engine._step

    def failing_step(self, *args):
        count[0] += 1
        if count[0] == int(after):
            raise RuntimeError(f"injected failure on rank {rank}")
        yield from step(self, *args)

    engine.Engine._step = failing_step

sys.argv = ["evalkit", *sys.argv[1:]]
main()
