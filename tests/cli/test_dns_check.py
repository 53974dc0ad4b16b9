"""The start-up DNS check (cli/dns_check.py) with the real resolver: one sentence per host that does not
resolve, naming who dials it; IP literals are never looked up."""

from __future__ import annotations

from kvindex.cli.dns_check import needs_lookup, warn_unresolved_hosts


def test_one_warning_per_unresolved_host_naming_every_pod() -> None:
    warnings: list[str] = []
    targets = [
        ("pod 'a' dp rank 0 (events)", "nowhere.invalid", 5557),
        ("pod 'a' dp rank 1 (events)", "nowhere.invalid", 5558),
        ("pod 'b' dp rank 0 (events)", "localhost", 5557),
        ("pod 'c' dp rank 0 (events)", "127.0.0.1", 5557),
    ]
    threads = warn_unresolved_hosts(targets, warnings.append)
    assert len(threads) == 2  # nowhere.invalid and localhost; the IP literal needs no lookup
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive()
    (warning,) = warnings
    assert warning.startswith("host 'nowhere.invalid' does not resolve (")
    assert "used by pod 'a' dp rank 0 (events), pod 'a' dp rank 1 (events);" in warning


def test_ip_literals_need_no_lookup() -> None:
    assert not needs_lookup("10.0.0.1")
    assert not needs_lookup("::1")
    assert not needs_lookup("fe80::1%eth0")
    assert needs_lookup("pod-a.ns.svc")
