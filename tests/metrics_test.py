"""The metrics writer on resume: JSONL rows after the checkpoint are dropped (a torn last
row too), and TensorBoard is told to purge the stopped run's later events."""

import json
import struct

from tensorboardX.proto import event_pb2

from jaxrl_llm.train.metrics import MetricsWriter


def _events(path):
  data, i, out = path.read_bytes(), 0, []
  while i < len(data):
    (n,) = struct.unpack("Q", data[i : i + 8])
    event = event_pb2.Event()
    event.ParseFromString(data[i + 12 : i + 12 + n])
    out.append(event)
    i += 12 + n + 4
  return out


def test_resume_truncates_jsonl_and_purges_tensorboard(tmp_path):
  first = MetricsWriter(tmp_path)
  for step in range(1, 6):
    first.write(step, {"x": float(step)})
  first.close()
  with (tmp_path / "metrics.jsonl").open("a") as f:
    f.write('{"step": 6, "x"')  # the process died mid-write
  resumed = MetricsWriter(tmp_path, start_step=2)
  for step in range(3, 5):
    resumed.write(step, {"x": 10.0 + step})
  resumed.close()
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
  assert [(r["step"], r["x"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]
  by_order = lambda p: int(p.name.rsplit(".", 1)[1])  # the writer counter ends the name
  first_file, second_file = sorted((tmp_path / "tb").iterdir(), key=by_order)
  assert [e.step for e in _events(first_file) if e.HasField("summary")] == [1, 2, 3, 4, 5]
  purge = [e for e in _events(second_file) if e.HasField("session_log")]
  assert [(e.step, e.session_log.status) for e in purge] == [(3, event_pb2.SessionLog.START)]


def test_values_without_a_point_stay_out_of_tensorboard(tmp_path):
  """A step with no correct answer has no response_length_correct: the JSONL row holds
  null and TensorBoard gets no NaN or Inf (tensorboardX warns on each)."""
  writer = MetricsWriter(tmp_path)
  writer.write(1, {"reward_mean": 0.5, "response_length_correct": None, "ratio": float("nan")})
  writer.write(2, {"reward_mean": 0.7, "response_length_correct": 3.0, "ratio": float("inf")})
  writer.close()
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
  assert rows[0]["response_length_correct"] is None and rows[0]["ratio"] is None
  (events_file,) = (tmp_path / "tb").iterdir()
  points = [
    (e.step, v.tag, v.simple_value)
    for e in _events(events_file)
    if e.HasField("summary")
    for v in e.summary.value
  ]
  assert sorted(points) == [
    (1, "reward_mean", 0.5),
    (2, "response_length_correct", 3.0),
    (2, "reward_mean", 0.699999988079071),
  ]
