"""The session layer: a conversation pinned to its KV, run turn by turn or step by step.

``_session_core`` (the conversation, its pin and engine), ``_session_edits`` (rewind, edits, snapshot and fork),
``_turn_api`` (``run``/``stream``: the SDK's tool loop) and ``_step_api`` (``step``/``extends``: caller-made
messages) over it, ``_session`` (`Session`: both APIs and the edits), ``_session_config`` (the frozen arguments), ``_modes`` (the session modes, read off the engine's flags), ``_turn`` (one turn as named steps; the push-back rule it
obeys is ``agentkv._engines._pinning``), ``_results`` (what a turn returns and streams). The public names are
re-exported by ``agentkv``.
"""
