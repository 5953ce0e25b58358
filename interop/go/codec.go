package main

import (
	"fmt"

	"google.golang.org/grpc/encoding"
	"google.golang.org/protobuf/proto"
)

// protoCodec marshals messages with google.golang.org/protobuf/proto. grpc-go before 1.35 (Debian ships 1.33)
// marshals with the old github.com/golang/protobuf codec, which Debian packages at 1.3: it cannot read the
// messages of today's protoc-gen-go and panics on the first call ("protobuf tag not enough fields in
// GetGlobalConfigResponse.state"). Registered under grpc's own name "proto", it replaces that codec for every
// call in this program; with a newer grpc-go it does what grpc's own codec does.
type protoCodec struct{}

func (protoCodec) Name() string { return "proto" }

func (protoCodec) Marshal(value interface{}) ([]byte, error) {
	message, ok := value.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("cannot marshal %T: not a protobuf message", value)
	}
	return proto.Marshal(message)
}

func (protoCodec) Unmarshal(data []byte, value interface{}) error {
	message, ok := value.(proto.Message)
	if !ok {
		return fmt.Errorf("cannot unmarshal into %T: not a protobuf message", value)
	}
	return proto.Unmarshal(data, message)
}

func init() { encoding.RegisterCodec(protoCodec{}) }
