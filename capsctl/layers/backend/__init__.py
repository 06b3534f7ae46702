"""How a vote-sized pass runs: dispatch.py (the one switch, :func:`~dispatch.choose` and
:func:`~dispatch.use`), chunks.py (chunk sizes and the threads that share a pass's sites),
native.py and native_check.py (build, cache, checks and load of the compiled library),
bindings.py (one Python function per ``extern "C"`` function of the library) and csrc/ (the
C++ sources, one per pass; the ABI version in csrc/abi.h). Imports nothing else of
capsctl/layers/; room for other backends (e.g. ``triton/``) beside csrc/.
"""
