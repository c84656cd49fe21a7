# TUNING 203-204's ring schedule, checked on the CPU (not the kernel itself): for kStages 2-4, windows of 8 and 32
# chunks and 0-299 chunks a warp, every ring read of chunk j finds j's entry in its slot, staged in a commit group
# that the loop's cp_async_wait has already covered, and no staging into that slot pending. `python3 benchmarks/dev/ring_schedule_check.py`
def check(kStages, W, nchunks):
    R = 2 * W
    slot_writer = {}      # slot -> (chunk staged, group id)
    group_of_next = 0     # id of the group being filled (uncommitted)
    committed = []        # group ids in order
    completed = set()
    pending_stage = []    # (slot, chunk) staged into the open group
    def stage_window(w):
        for c in range(W * w, W * w + W):
            if c < nchunks:
                pending_stage.append((c % R, c))
    def commit():
        nonlocal group_of_next
        for s, c in pending_stage:
            slot_writer[s] = (c, group_of_next)
        pending_stage.clear()
        committed.append(group_of_next); group_of_next += 1
    def wait(allow):      # all but the newest `allow` committed groups complete
        for g in committed[:len(committed) - allow]:
            completed.add(g)
    def read(j):
        s = j % R
        assert s in slot_writer, (kStages, W, nchunks, j, 'never staged')
        c, g = slot_writer[s]
        assert c == j, (kStages, W, nchunks, j, 'slot holds chunk', c)
        assert g in completed, (kStages, W, nchunks, j, 'group not waited')
        # a staging into the slot still open (issued, uncommitted) would race the read:
        assert all(ps != s for ps, _ in pending_stage), (kStages, W, nchunks, j, 'overwrite pending')
    commit()  # Q's group
    for s in range(kStages - 1):
        # load chunk s from the table (no ring read)
        if s == 0: stage_window(0)
        commit()
    i0 = 0
    while i0 < nchunks:
        stage_window(i0 // W + 1)
        for i in range(i0, min(i0 + W, nchunks)):
            wait(kStages - 2)
            j = i + kStages - 1
            if j < nchunks: read(j)
            commit()
        i0 += W
for kStages in (2, 3, 4):
    for W in (8, 32):
        if W < 2 * kStages - 2: continue
        for n in range(0, 300):
            check(kStages, W, n)
print("ok")
