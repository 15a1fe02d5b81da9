# The compiled twin replay_c is typed by replay.pxd (the declarations other twins cimport).
include "replay.pxd"
