"""Tests for the stage's threads (`stage.in_background`): work off the caller."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_interpreter_exit_waits_for_background_work(tmp_path):
  # An export with validate=False returns while its variables' fill still
  # runs; a script may end right there. The work must finish before the
  # interpreter finalizes (a daemon thread would be stopped mid-way, inside
  # native code: the process then aborts).
  out = tmp_path / 'done.txt'
  script = textwrap.dedent(f"""
      import time
      from t5export._src.engine import stage
      def work():
        time.sleep(1.0)  # Still running when the main thread ends.
        with open({str(out)!r}, 'w') as f:
          f.write('finished')
      stage.in_background(work, 't5export-exit-test')
      """)
  proc = subprocess.run([sys.executable, '-c', script], capture_output=True,
                        text=True, timeout=60, check=False)
  assert proc.returncode == 0, proc.stderr
  assert out.read_text() == 'finished'


def test_an_error_in_background_work_reaches_its_future():
  from t5export._src.engine import stage  # pylint: disable=g-import-not-at-top

  def fail():
    raise ValueError('the copy failed')

  error = stage.in_background(fail, 't5export-error-test').exception(60)
  assert isinstance(error, ValueError) and str(error) == 'the copy failed'
