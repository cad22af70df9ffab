"""The load tester: traces (``trace``, ``distributions``, ``scenarios``), the systems that
serve them (``runner`` over gRPC, ``engine_replay`` in process, ``baseline`` for
transformers + peft, behind ``targets``), the timing log (``records``), the figures
(``report``, ``plots``), sweeps (``sweep``) and the command line (``cli``:
``python -m loraplex.loadtest`` or ``loraplex bench``)."""
