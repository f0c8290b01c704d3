//! The future a [`Producer`](super::Producer) call returns.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::sync::oneshot;

use super::record::{ProduceError, Stored};

type Answer = Result<Stored, ProduceError>;

/// Resolves to where Kinesis stored the record, or why it did not.
pub struct ResponseFuture {
    state: State,
}

enum State {
    /// The record is with the background task; its answer comes here.
    Waiting(oneshot::Receiver<Answer>),
    /// Refused up front (or already answered).
    Done(Option<ProduceError>),
}

impl ResponseFuture {
    pub(crate) fn waiting(answer: oneshot::Receiver<Answer>) -> Self {
        ResponseFuture {
            state: State::Waiting(answer),
        }
    }

    pub(crate) fn failed(error: ProduceError) -> Self {
        ResponseFuture {
            state: State::Done(Some(error)),
        }
    }
}

impl Future for ResponseFuture {
    type Output = Answer;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Answer> {
        let answer = match &mut self.state {
            // The task dropped the sender without answering: it stopped (runtime
            // shutting down, or the producer closed before the record was taken).
            State::Waiting(rx) => match Pin::new(rx).poll(cx) {
                Poll::Ready(answer) => answer.unwrap_or(Err(ProduceError::Closed)),
                Poll::Pending => return Poll::Pending,
            },
            State::Done(error) => Err(error.take().unwrap_or(ProduceError::Closed)),
        };
        self.state = State::Done(None);
        Poll::Ready(answer)
    }
}

impl fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Waiting(_) => "waiting",
            State::Done(_) => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish()
    }
}
