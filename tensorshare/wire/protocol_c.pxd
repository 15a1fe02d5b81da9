# The compiled twin protocol_c is typed by protocol.pxd (the declarations other twins cimport).
include "protocol.pxd"
