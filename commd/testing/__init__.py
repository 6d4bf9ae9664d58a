"""commd.testing: the one harness the tests, benchmarks and examples share.

``daemons`` (local daemons), ``processes`` (subprocesses and JSON-line workers), ``harness``
(what a benchmark starts and stops: daemons with their logs, workers), ``netbed`` (network
namespaces, a bridge, tbf-shaped links, a link cut; root only), ``fuzz`` (hostile frames),
``results`` and ``provenance`` (a benchmark's results as JSON with the command, commit and
machine), ``tables`` (Markdown tables), ``scripts`` (a file outside any package loaded by its
path), ``ports`` and ``peers``. Standard library only, besides commd itself, except ``fuzz``
(msgpack, a development dependency); commd never imports this package."""
