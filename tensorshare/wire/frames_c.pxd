# The compiled twin frames_c is typed by frames.pxd (the declarations other twins cimport).
include "frames.pxd"
