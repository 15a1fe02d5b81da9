# The compiled twin session_c is typed by session.pxd (the declarations other twins cimport).
include "session.pxd"
