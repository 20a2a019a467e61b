"""An agent that never finishes: it starts a child that sleeps too (pid written to
``$TASK_PID_DIR/<rollout>~<attempt>.child``) and, when ``$TASK_IGNORE_TERM`` is "true", both ignore
SIGTERM, so only SIGKILL to the whole process group ends them."""

import os
import signal
import subprocess
import sys
import time

ignore = os.environ.get("TASK_IGNORE_TERM") == "true"
if ignore:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
code = ("import signal, time\n"
        + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore else "")
        + "time.sleep(300)\n")
child = subprocess.Popen([sys.executable, "-c", code])
name = f"{os.environ['LGT_ROLLOUT_ID']}~{os.environ['LGT_ATTEMPT']}"
path = os.path.join(os.environ["TASK_PID_DIR"], name + ".child")
with open(path + ".tmp", "w") as f:
    f.write(str(child.pid))
os.replace(path + ".tmp", path)
print("started child", child.pid, flush=True)
time.sleep(300)
