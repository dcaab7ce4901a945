"""The moto server the tests and the benchmark run: moto's own `moto_server`
with two of its faults mended. Imports nothing of the tests' (the
benchmark starts it too: bench.reference.start_moto)."""

# What `moto_server` runs (`python -c MOTO_MAIN -H HOST -p PORT`), after two
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
MOTO_MAIN = """
import sys, time
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
from moto.server import main
sys.exit(main(sys.argv[1:]))
"""
