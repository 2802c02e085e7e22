"""Every exit code of ``reprotrain``, in one place, with what it means.

0 means done: the command did what was asked and, for a check, found
nothing wrong. A command's ``run`` returns one of the verdict codes below
when it printed its own output; the CLI turns the errors it catches into
:data:`EXIT_BAD_INPUT`, :data:`EXIT_NOT_DETERMINISTIC` and
:data:`EXIT_INTERRUPTED`, with one ``reprotrain: error:`` line. A CI job
can branch on them: 1, 4, 5 and 6 are verdicts about the bits; 2, 3 and 7
say the check could not be made as asked.
"""

from __future__ import annotations

#: A check failed: ``checklist --strict`` has a failing item; ``verify``,
#: ``compare``, ``locate`` or ``opdiff`` found a difference; ``status``: ``dvc repro``
#: would change something that decides the bits.
EXIT_CHECK_FAILED = 1
#: Bad input (params, data, model, lock, record file, a command line): nothing written.
EXIT_BAD_INPUT = 2
#: The determinism guarantee cannot be honoured in this process.
EXIT_NOT_DETERMINISTIC = 3
#: ``verify -- CMD``: every tensor equal, another file (a log, a config) differs.
EXIT_DIFFERS_OUTSIDE_TENSORS = 4
#: ``verify -- CMD``: a file cannot be read as its kind.
EXIT_UNREADABLE = 5
#: ``verify --reference``: every output as committed, but the record that decides
#: the bits (environment record, run ID) differs; a CI job may choose to accept it.
EXIT_RECORD_DIFFERS = 6
#: ``verify-attestation --rebuild``: this host's deciding record is not the attested one
#: (another GPU model, CPU vendor...), so it cannot rebuild those bits; nothing was judged.
EXIT_UNVERIFIABLE_HERE = 7
#: Interrupted (SIGINT or SIGTERM), as a shell reports a process ended by SIGINT.
EXIT_INTERRUPTED = 130

#: How the CLI starts the one line it prints for an error it catches (a run's own refusal
#: is found by it in the run's stderr).
ERROR_PREFIX = "reprotrain: error: "
