"""The journal: every decision a process answers, on its own disk, outside Redis.

- `records`: what a line holds (format version 1, docs/journal.md);
- `writer`: the append-only, hash-chained files, group commit;
- `recorder`: what the use-cases journal, in their own terms;
- `reader`: reading the files back, checking their chains;
- `restore`: putting back into a Redis what it lost (and the identity gate that holds
  sales until then);
- `verify`: the `capsvc journal verify` check.
"""
