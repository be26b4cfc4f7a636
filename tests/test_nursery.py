"""kvfs.nursery: a nursery's failure is the exception a task raised, never a group of them,
whichever trio is installed (trio >= 0.25 groups even a single one)."""

import errno

import pytest
import trio

from kvfs.nursery import first_error, open_nursery


class NoRoom(Exception):
    pass


def test_one_failing_task_raises_its_own_exception():
    async def fail():
        raise OSError(errno.ENOSPC, "full")

    async def main():
        async with open_nursery() as nursery:
            nursery.start_soon(fail)
            nursery.start_soon(trio.sleep_forever)  # cancelled by the failure

    with pytest.raises(OSError) as info:
        trio.run(main)
    assert info.value.errno == errno.ENOSPC


def test_several_failures_raise_the_first_one():
    async def fail(exc, delay):
        await trio.sleep(delay)
        raise exc

    async def main():
        async with open_nursery() as nursery:
            nursery.start_soon(fail, NoRoom("first"), 0)
            nursery.start_soon(fail, NoRoom("second"), 0)

    with pytest.raises(NoRoom):
        trio.run(main)


def test_the_body_raising_is_not_wrapped_either():
    async def main():
        async with open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            raise NoRoom("body")

    with pytest.raises(NoRoom, match="body"):
        trio.run(main)


def test_first_error_skips_cancellations_and_unwraps_nested_groups():
    inner = NoRoom("inner")
    group = ExceptionGroup("outer", [ExceptionGroup("mid", [inner]), ValueError("later")])
    assert first_error(group) is inner
    assert first_error(inner) is inner


def test_a_cancelled_nursery_stays_cancelled():
    async def main():
        with trio.move_on_after(0.01) as scope:
            async with open_nursery() as nursery:
                nursery.start_soon(trio.sleep_forever)
                nursery.start_soon(trio.sleep_forever)
        return scope.cancelled_caught

    assert trio.run(main)
