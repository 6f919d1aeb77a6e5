"""The metric catalogue is the only definition: each registry exposes exactly the
families listed for it, with the catalogue's labels and buckets."""

from __future__ import annotations

from collections import Counter

from prometheus_client import CollectorRegistry

from kv_transfer.metrics import KVTransferCollector, Ledger, TransferTotals
from loadgen.client.fake_server import FakeServerConfig, _Metrics
from loadgen.outputs.exposition import Exposition
from router.observation.metrics import ROUTER_ATTRIBUTES, RouterMetrics
from splitserve import metric_catalogue as catalogue
from tests.dashboards.names import registry_names

# prometheus-client's own process metrics, which the router's registry adds.
PROCESS_PREFIX = "process_"


def test_every_family_and_header_has_one_name() -> None:
    names = Counter(family.name for family in catalogue.ALL_FAMILIES)
    assert [name for name, count in names.items() if count > 1] == []
    headers = [value for name, value in vars(catalogue).items() if name.endswith("_HEADER")]
    assert len(headers) == len(set(headers)) == 5


def test_the_router_registers_exactly_its_catalogue_families() -> None:
    metrics = RouterMetrics()
    exposed = {n for n in registry_names(metrics.registry) if not n.startswith(PROCESS_PREFIX)}
    assert exposed == catalogue.series_of(catalogue.ROUTER_FAMILIES)
    assert set(ROUTER_ATTRIBUTES.values()) == set(catalogue.ROUTER_FAMILIES)
    for attribute, family in ROUTER_ATTRIBUTES.items():
        registered = getattr(metrics, attribute)
        assert registered._labelnames == family.labels, family.name
        if family.kind == "histogram":
            assert tuple(registered._upper_bounds[:-1]) == family.buckets, family.name


def test_the_kv_collector_renders_exactly_the_kv_families() -> None:
    registry = CollectorRegistry()
    totals = TransferTotals()
    totals.observe("put", 0.02, 1 << 20, first_part=True)
    ledger = Ledger().snapshot(1, 1 << 20)
    registry.register(KVTransferCollector(lambda: totals, lambda: ledger))
    assert registry_names(registry) == catalogue.series_of(catalogue.KV_FAMILIES)
    buckets = {
        sample.labels["le"]
        for family in registry.collect()
        for sample in family.samples
        if sample.name == catalogue.KV_SECONDS.bucket
    }
    assert buckets == {repr(bound) for bound in catalogue.KV_SECONDS.buckets} | {"+Inf"}


def test_the_load_generator_exposes_exactly_its_families() -> None:
    exposition = Exposition()
    exposition.for_run("run", "dp", "general", 4.0)
    assert registry_names(exposition.registry) == catalogue.series_of(catalogue.LOADGEN_FAMILIES)


def test_the_fake_server_speaks_a_subset_of_the_routers_catalogue() -> None:
    """The load generator reads a fake server as it reads the router: the same names
    and labels, so neither can drift from the other."""
    metrics = _Metrics(FakeServerConfig(port=0))
    metrics.update_gauges(kv_tokens=10)
    by_name = {family.name: family for family in catalogue.ALL_FAMILIES}
    for family in metrics.registry.collect():
        listed = by_name[family.name]
        for sample in family.samples:
            labels = set(sample.labels) - {"le"}
            assert labels == set(listed.labels), (family.name, labels)
