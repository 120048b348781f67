"""What reward functions log through `log_extra` / `log_metric`, gathered over processes.

Two "processes" are two threads whose `gather_object` is a real all-gather between them (a barrier exchanging
lists), so a gather that one process skips, or makes in another order, deadlocks or mixes columns here as it would
under accelerate.
"""

import threading

from grpo_trainer.reporting.reward_logs import RewardLogs


class ThreadWorld:
    """all_gather_object for `size` threads: each passes a list, all get the lists concatenated in rank order."""

    def __init__(self, size: int) -> None:
        self.size, self.slots = size, [None] * size
        self.barrier = threading.Barrier(size, timeout=10)

    def gather_object(self, rank: int):
        def gather(values: list) -> list:
            self.slots[rank] = list(values)
            self.barrier.wait()
            out = [v for slot in self.slots for v in slot]
            self.barrier.wait()  # every rank has read the slots before any rank writes its next list
            return out
        return gather

    def run(self, work) -> list:
        results, errors = [None] * self.size, []

        def target(rank):
            try:
                results[rank] = work(rank, self.gather_object(rank))
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


def test_columns_are_gathered_in_process_order_and_missing_ones_are_none():
    def work(rank, gather):
        logs = RewardLogs()
        # rank 0 logs "b" then "a"; rank 1 only "a", in two calls (log_extra extends, as TRL's)
        if rank == 0:
            logs.log_extra("b", ["b0", "b1"])
            logs.log_extra("a", [0, 1])
        else:
            logs.log_extra("a", [2])
            logs.log_extra("a", [3])
        columns = logs.gather_columns(2, gather)
        assert not logs.columns  # cleared for the next round
        return columns

    rank0, rank1 = ThreadWorld(2).run(work)
    assert rank0 == rank1 == {"a": [0, 1, 2, 3], "b": ["b0", "b1", None, None]}


def test_a_metric_is_the_mean_of_every_value_logged_on_every_process():
    def work(rank, gather):
        logs = RewardLogs()
        for value in ([0.25, 0.75] if rank == 0 else [2.0]):  # rank 1 alone logs "only_one"
            logs.log_metric("accuracy", value)
        if rank == 1:
            logs.log_metric("only_one", 4)
        return logs.gather_metrics(gather)

    # accuracy: (0.25 + 0.75 + 2.0) / 3 = 1.0, not the mean of the process means (0.5 + 2) / 2 = 1.25
    assert ThreadWorld(2).run(work) == [{"accuracy": 1.0, "only_one": 4.0}] * 2


def test_a_column_of_the_wrong_length_names_the_column_on_every_process():
    def work(rank, gather):
        logs = RewardLogs()
        logs.log_extra("source", ["x", "y", "z"] if rank == 1 else ["x", "y"])  # rank 1 logged one too many
        try:
            logs.gather_columns(2, gather)
        except ValueError as exc:
            assert not logs.columns
            return str(exc)

    messages = ThreadWorld(2).run(work)  # rank 0 raises too, instead of waiting in a gather rank 1 never makes
    assert all(m.startswith("log_extra('source', ...) received 3 values in this round for 2 completions")
               for m in messages), messages


def test_one_process_gathers_its_own_values():
    logs = RewardLogs()
    logs.log_extra("source", ["x", "y"])
    logs.log_metric("m", 1)
    logs.log_metric("m", 2)
    assert logs.gather_columns(2, lambda values: values) == {"source": ["x", "y"]}
    assert logs.gather_metrics(lambda values: values) == {"m": 1.5}
    assert logs.gather_columns(2, lambda values: values) == {} and logs.gather_metrics(lambda v: v) == {}
