"""The thread count follows the cores other processes leave free (specdec/threads.py), from fake
/proc/stat figures: no real load, no timing."""

from specdec import threads

STAT = """cpu  {t0} 0 0 0 0 0 0 0 0 0
cpu0 {b0} 0 0 {i0} 0 0 0 0 0 0
cpu1 {b1} 0 0 {i1} 0 0 0 0 0 0
intr 1 2 3
"""


def stat(b0, i0, b1, i1):
    return STAT.format(t0=b0 + b1, b0=b0, i0=i0, b1=b1, i1=i1)


def test_read_cpu_jiffies_sums_allowed_cpus_only():
    text = "cpu0 10 1 2 100 7 0 0 0 0 0\ncpu1 50 0 0 50 0 0 0 0 0 0\n"
    # busy = user + nice + system (+ irq, softirq, steal); idle and iowait are not busy
    assert threads.read_cpu_jiffies([0], text) == (13, 120)
    assert threads.read_cpu_jiffies([0, 1], text) == (63, 220)
    assert threads.read_cpu_jiffies([5], text) is None


def test_choose_threads_counts_a_core_free_only_while_others_use_little_of_it():
    assert threads.choose_threads(2, 0.0) == 2
    assert threads.choose_threads(2, 0.2) == 2  # light background work: its core still counts as free
    assert threads.choose_threads(2, 0.3) == 1  # a thread there would stall every barrier now and then
    assert threads.choose_threads(2, 0.6) == 1
    assert threads.choose_threads(2, 2.0) == 1  # never fewer than one
    assert threads.choose_threads(8, 3.0) == 5
    assert threads.choose_threads(8, 2.8) == 5


def test_others_busy_subtracts_own_time():
    # 2 cpus, 100 ticks each elapsed (1 s at 100 Hz): 150 busy ticks, 0.5 s of them ours
    hz = threads.CLOCK_TICKS
    got = threads.others_busy_cores((0, 0), (int(1.5 * hz), 2 * hz), own_s=0.5, ncpus=2)
    assert abs(got - 1.0) < 1e-9
    assert threads.others_busy_cores((0, 0), (3, 4), own_s=0.0, ncpus=2) is None  # too short to tell


class FakeMachine:
    """Ticks advance by hand: `run(seconds, others_cores, own_cores)`."""

    def __init__(self):
        self.busy = self.total = 0
        self.own = 0.0
        self.now = 0.0

    def run(self, seconds, others, own):
        hz = threads.CLOCK_TICKS
        self.total += int(2 * seconds * hz)
        self.busy += int((others + own) * seconds * hz)
        self.own += own * seconds
        self.now += seconds


def make_governor(m, calls):
    return threads.ThreadGovernor(interval=0.5, set_threads=calls.append, sample=lambda: (m.busy, m.total),
                                  own=lambda: m.own, cpus=[0, 1], clock=lambda: m.now)


def test_governor_follows_load():
    m, calls = FakeMachine(), []
    g = make_governor(m, calls)
    m.run(1.0, others=0.05, own=1.0)  # start-up: we load on one core, the machine is otherwise idle
    assert g.adjust() == 2 and calls == [2]
    m.run(0.2, others=2.0, own=0.0)
    g.tick()  # under the interval: nothing measured yet
    assert calls == [2]
    m.run(0.4, others=1.3, own=0.7)  # two busy loops arrive
    g.tick()
    assert calls == [2, 1]
    m.run(0.6, others=1.4, own=0.6)  # still there: no change, no call
    g.tick()
    assert calls == [2, 1]
    m.run(0.6, others=0.0, own=1.0)  # they end
    g.tick()
    assert calls == [2, 1, 2] and g.changes == 2
    m.run(0.6, others=0.35, own=1.6)  # a process using a third of a core: its core is not free
    g.tick()
    assert calls == [2, 1, 2, 1]


def test_start_respects_fixed_and_environment(monkeypatch):
    import torch

    before = torch.get_num_threads()
    try:
        g = threads.start(1)
        assert g.fixed == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert threads.start(None).fixed == torch.get_num_threads()
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert threads.start(None).fixed is None
    finally:
        threads.stop()
        torch.set_num_threads(before)


def test_the_kernels_pool_is_on_while_a_core_is_shared_also_at_a_fixed_count():
    """Idle: OpenMP's team (no switch); beside busy processes: the pool, on every allowed core or
    on the fixed count; back off when they end. A fixed count is never changed."""
    for fixed, pool_threads in ((None, 2), (2, 2)):
        m, calls, pool = FakeMachine(), [], []
        g = threads.ThreadGovernor(interval=0.5, set_threads=calls.append, sample=lambda: (m.busy, m.total),
                                   own=lambda: m.own, cpus=[0, 1], clock=lambda: m.now, fixed=fixed,
                                   set_pool=lambda on, n: pool.append((on, n)))
        m.run(1.0, others=0.05, own=1.0)
        g.adjust()
        assert pool == [(False, pool_threads)]
        m.run(0.6, others=1.3, own=0.7)  # two busy loops
        g.tick()
        assert pool == [(False, pool_threads), (True, pool_threads)]
        m.run(0.6, others=1.4, own=0.6)  # still there: no new switch
        g.tick()
        assert len(pool) == 2
        m.run(0.6, others=0.0, own=1.0)
        g.tick()
        assert pool[-1] == (False, pool_threads)
        assert calls == ([2, 1, 2] if fixed is None else [])


def test_a_forced_pool_is_not_switched(monkeypatch):
    saved = threads._kernel_pool
    try:
        monkeypatch.setenv("SPECDEC_KERNEL_POOL", "1")
        threads._kernel_pool = None
        threads.use_kernel_pool(lambda on, n: None)
        assert threads._kernel_pool is None
    finally:
        threads._kernel_pool = saved
