"""commd.testing: the one harness the tests, benchmarks and examples share.

``daemons`` (local daemons), ``processes`` (subprocesses and JSON-line workers), ``ranks``
(a job of real ranks: its spec, its ranks started as ``rank_worker`` processes, their results
checked exactly), ``harness`` (what a benchmark starts and stops: daemons with their logs,
workers), ``netbed`` (network namespaces, a bridge, tbf-shaped links, a link cut; root only),
``fuzz`` (hostile frames), ``results`` and ``provenance`` (a benchmark's results as JSON with
the command, commit and machine), ``tables`` (Markdown tables), ``scripts`` (a file outside
any package loaded by its path), ``ports`` and ``peers``. Only commd's own dependencies,
besides ``fuzz`` (msgpack and hypothesis, development dependencies) and ``rank_worker``
(a client: it imports commd_client); commd never imports this package."""
