from loadgen.bench import run_settings


def test_baselines_run_without_replication_unless_told_otherwise() -> None:
    assert run_settings([], "cost") == []
    assert run_settings(["policy.cost.tie_margin=0"], "cost") == ["policy.cost.tie_margin=0"]
    assert run_settings([], "prefix_affinity") == ["replication.enabled=false"]
    assert run_settings(["scrape.interval_ms=50"], "round_robin") == ["replication.enabled=false", "scrape.interval_ms=50"]
    assert run_settings(["replication.enabled=true"], "least_loaded") == ["replication.enabled=true"]
