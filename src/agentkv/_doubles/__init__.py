"""The test doubles behind `agentkv.testing` (src/agentkv/testing.py): the scripted engine (`_scripted.py`) and
the honest pair (`_honest_pair.py`, with the faults it plays: `_honest_faults.py`)."""
