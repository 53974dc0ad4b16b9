"""benchmarks/wake.py and the floor's WORK_US: real floor servers on 127.0.0.1, asked through TimedClient."""

from __future__ import annotations

import pytest

from benchmarks.floor import FloorServer
from benchmarks.service import TimedClient
from benchmarks.wake import PATH, request_body, sweep

pytestmark = pytest.mark.timeout(120)

ANSWER = b'{"scores":[]}'


@pytest.mark.parametrize("work_us", [0.0, 20_000.0])
def test_a_floor_answers_its_canned_answer_and_no_sooner_than_its_work(work_us: float) -> None:
    with FloorServer(ANSWER, work_us=work_us) as server:
        client = TimedClient(server.port)
        try:
            answers = [client.post(PATH, request_body()) for _ in range(4)]
        finally:
            client.close()
    assert all(body == ANSWER for _, body in answers)
    # The only lower bound the box guarantees: the server spins at least that long before writing.
    assert all(seconds >= work_us / 1e6 for seconds, _ in answers)
    if work_us == 0:
        assert min(seconds for seconds, _ in answers) < 0.020


def test_sweep_times_every_server_the_asked_number_of_times() -> None:
    rows = sweep([0.0, 50.0], requests=25)
    assert [row.work_us for row in rows] == [0.0, 50.0]
    for row in rows:
        assert len(row.samples_s) == 25
        assert 0 <= row.on_client_cpu <= 25
        assert 0.0 <= row.share_on_client_cpu() <= 1.0
        assert row.percentile_ms(0.5) <= row.percentile_ms(0.9) <= row.percentile_ms(0.99)
    assert min(rows[1].samples_s) >= 50e-6
