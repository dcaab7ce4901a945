"""The moto server the tests and the benchmark run: moto's own `moto_server`
with three of its faults mended. Imports nothing of the tests' (the
benchmark starts it too: bench.reference.start_moto)."""

# What `moto_server` runs (`python -c MOTO_MAIN -H HOST -p PORT`), after three
# changes:
# - moto's SQS model asks its clock helper (datetime arithmetic, ~20 us)
#   about every stored message several times per request, which makes a
#   queue of a thousand messages take seconds per call on a busy machine.
#   time.time() gives the same number, much faster.
# - moto's Queue.delete_message rebuilds the queue's list of messages
#   without the lock that add_message takes, so a message sent while
#   another is deleted can vanish after SendMessage(Batch) reported it
#   sent (moto 5.2.5). The kill -9 test of the outbox on SQS, whose
#   collector deletes while relay sends, missed 6 to 56 of 1,000 such
#   messages in about one run of ten on four workers. It runs under the
#   lock here, as real SQS keeps what it acknowledged.
# - moto's SQSBackend.receive_message notes which FIFO groups have messages
#   in flight once, when a call begins, and not again while it long-polls or
#   while another call takes messages beside it (no lock), so two of relay's
#   concurrent receivers could each get part of one group: a key's messages
#   then reached the inbox out of order (seen once in a full run, in
#   tests/e2e/test_claim_check.py). Real SQS never hands out a group's
#   messages while earlier ones are in flight. Here each pass over the queue
#   runs under one lock and starts from the groups in flight now; the long
#   poll waits between passes, outside it.
MOTO_MAIN = """
import sys, threading, time
import moto.core.utils
import moto.sqs.models as models
slow = moto.core.utils.unix_time
def unix_time(dt=None):
    return time.time() if dt is None else slow(dt)
def unix_time_millis(dt=None):
    return unix_time(dt) * 1000.0
if hasattr(models, "unix_time") and hasattr(models, "unix_time_millis"):
    models.unix_time, models.unix_time_millis = unix_time, unix_time_millis
_delete = models.Queue.delete_message
def delete_message(self, receipt_handle):
    with self._messages_lock:  # a Condition over an RLock
        return _delete(self, receipt_handle)
models.Queue.delete_message = delete_message
_receive = models.SQSBackend.receive_message
_receiving = threading.Lock()
def receive_message(self, queue_name, count, wait_seconds_timeout, visibility_timeout,
                    message_attribute_names=None):
    end = time.time() + (wait_seconds_timeout or 0)
    while True:
        with _receiving:
            found = _receive(self, queue_name, count, 0, visibility_timeout,
                             message_attribute_names)
        left = end - time.time()
        if found or left <= 0:
            return found
        queue = self.get_queue(queue_name)
        if queue.messages:  # there, but in flight or held by their group
            time.sleep(min(0.05, left))
        else:
            queue.wait_for_messages(min(1.0, left))
models.SQSBackend.receive_message = receive_message
from moto.server import main
sys.exit(main(sys.argv[1:]))
"""
