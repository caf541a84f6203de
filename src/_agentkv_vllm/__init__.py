"""agentkv's vLLM plugin: every change agentkv makes to vLLM, and all of agentkv's code that vLLM's processes load.

vLLM runs every ``vllm.general_plugins`` entry point in every process it starts (API
servers, engine cores, workers), for any vLLM in the environment, a user's unrelated
``vllm serve`` included. Importing a module imports its parent packages first, so an entry
point inside ``agentkv`` ran ``agentkv/__init__.py``, the public API: the session layer,
the front door (starlette, uvicorn), openai and httpx, about 1,070 modules and a second of
CPU in each of those processes, to do nothing in most of them. So the plugin is a separate
top-level package, shipped in agentkv's wheel (``[tool.hatch.build.targets.wheel]`` in
``pyproject.toml``):

* It **never imports agentkv**. agentkv imports from it (the environment it gives its
  engines, the core table, the patches it applies in its own process); never the reverse.
  Its modules import the standard library at import time, and vLLM, NIXL and torch only
  inside the functions that patch them. ``tests/test_plugin_imports.py`` loads the entry
  point as vLLM does, in a fresh interpreter, and checks what it imported.
* It holds **every change agentkv makes to vLLM's internals** (``_patches``), so what vLLM
  runs and what docs/vllm-patches.md describes are one place.

A lazy ``agentkv/__init__.py`` (names resolved on first use) would also keep the plugin
lean, but it hides the public names from readers, type checkers and the API reference, and
any eager import added to ``agentkv`` later would silently bring the cost back into every
vLLM process. A package that cannot reach agentkv makes the boundary structural.

Modules (none re-exported here, so importing one imports only what it needs):

* ``_patches``: the entry point (`_agentkv_vllm._patches.install`), the environment that
  switches it on (`_agentkv_vllm._patches.engine_env`), every patch, and the table of the features
  they serve with the targets each probes before it patches (`_agentkv_vllm._patches.FEATURES`).
* ``_elastic_worker``: elastic cores, a CPU worker's thread count following the core table.
* ``_cores``: the host's core table, written by agentkv's engines (`CoreTable`) and read by
  their workers.
* ``_push_connector``: ``AgentKVPushConnector``, which vLLM loads by module path
  (``kv_connector_module_path``) in the engine processes of a push pair with push-back.
"""
