"""The global batch size over a run: constant (--global-batch-size), ramped (--rampup-batch-size START INCREMENT
SAMPLES, Megatron-LM's) or stepped (--step-batch-size-schedule "THRESHOLD:BATCH ...", newer Megatron-LM's).

All three are one list of steps ``((first_sample, batch_size), ...)`` from sample 0 on: an iteration takes the
batch size of the last step at or below the samples consumed before it. The ramp is such a list, so every
megatron-core version trains the same batches: megatron-core 0.19 ignores a ramp (it takes steps), and 0.16's
calculator ramps by the same rule in floating point, which can round down exactly at a step's first sample; here
it is counted in integers.
"""


SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def rampup_steps(start: int, increment: int, ramp_samples: int, global_batch_size: int) -> tuple:
    """START, START + INCREMENT, ... up to the global batch size, evenly over RAMP_SAMPLES: step k of the n
    increments begins at the first sample count >= k * RAMP_SAMPLES / n, the full batch at RAMP_SAMPLES."""
    n = (global_batch_size - start) // increment
    return ((0, start),) + tuple((-(-k * ramp_samples // n), start + k * increment)
                                 for k in range(1, n + 1))


def _number(text: str, flag: str) -> int:
    """An int with an optional K/M/B/T suffix (Megatron-LM's schedule syntax)."""
    text = text.strip().upper()
    scale = SUFFIXES.get(text[-1:], 1)
    try:
        value = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a number (digits with an optional K, M, B or T)") from None
    return int(value)


def parse_step_schedule(text: str, seq_length: int) -> tuple:
    """--step-batch-size-schedule "THRESHOLD:BATCH ...": thresholds in tokens (Megatron-LM passes the sequence
    length to megatron-core, which converts them to samples), the first one 0, strictly increasing."""
    flag = "--step-batch-size-schedule"
    steps = []
    for entry in text.replace(",", " ").split():
        if ":" not in entry:
            raise ValueError(f'{flag}: entry {entry!r} is not THRESHOLD:BATCH_SIZE (e.g. "0:768 250B:1536")')
        threshold, batch = entry.split(":", 1)
        steps.append((_number(threshold, flag) // seq_length, _number(batch, flag)))
    steps.sort()
    if not steps or steps[0][0] != 0:
        raise ValueError(f"{flag}: the first threshold must be 0 (the batch size from the start), got {text!r}")
    if any(a[0] == b[0] for a, b in zip(steps, steps[1:])):
        raise ValueError(f"{flag}: two thresholds fall on the same sample (--seq-length {seq_length} tokens each) "
                         f"in {text!r}")
    if any(batch <= 0 for _, batch in steps):
        raise ValueError(f"{flag}: batch sizes must be positive, got {text!r}")
    return tuple(steps)


def batch_size_at(steps: tuple, consumed_samples: int) -> int:
    """The global batch size of the iteration that starts after ``consumed_samples``."""
    return [batch for first, batch in steps if first <= consumed_samples][-1]


def iterations_in(steps: tuple, train_samples: int) -> int:
    """Iterations of a --train-samples run: as many as fit, each of the batch size of its step."""
    iterations = consumed = 0
    ends = [first for first, _ in steps[1:]] + [None]
    for (_, batch), end in zip(steps, ends):
        if end is not None and consumed >= end:  # a batch of the previous step went past this one
            continue
        fit = (train_samples - consumed) // batch
        in_step = fit if end is None else min(fit, -(-(end - consumed) // batch))
        iterations, consumed = iterations + in_step, consumed + in_step * batch
        if in_step == fit:  # the samples ran out (or this is the last step)
            break
    return iterations
