# The compiled twin handlers_c is typed by handlers.pxd (the declarations other twins cimport).
include "handlers.pxd"
