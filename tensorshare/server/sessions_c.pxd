# The compiled twin sessions_c is typed by sessions.pxd (the declarations other twins cimport).
include "sessions.pxd"
